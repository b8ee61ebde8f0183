package tensor_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// Two drivers for the registry's tests, registered once for this test
// binary: "zfake" has two devices, CPU backends under its own names, and
// "afail" cannot count its devices.
func init() {
	tensor.RegisterDriver("zfake", fakeDriver{})
	tensor.RegisterDriver("afail", failDriver{})
}

type fakeDriver struct{}

func (fakeDriver) Count() (int, error) { return 2, nil }

func (fakeDriver) Open(ordinal int, o tensor.DeviceOptions) (tensor.Backend, error) {
	if ordinal < 0 || ordinal >= 2 {
		return nil, fmt.Errorf("zfake: device %d does not exist (have 2)", ordinal)
	}
	return named{tensor.NewCPU(o.Threads), fmt.Sprintf("zfake:%d", ordinal)}, nil
}

type named struct {
	*tensor.CPU
	name string
}

func (n named) Name() string { return n.name }

type failDriver struct{}

func (failDriver) Count() (int, error) { return 0, errors.New("afail: no driver") }

func (failDriver) Open(int, tensor.DeviceOptions) (tensor.Backend, error) {
	return nil, errors.New("afail: no driver")
}

func TestParseDevice(t *testing.T) {
	for _, c := range []struct {
		spec    string
		driver  string
		ordinal int
	}{{"cpu", "cpu", 0}, {"cuda", "cuda", 0}, {"cuda:1", "cuda", 1}, {"cpu:3", "cpu", 3}, {"auto", "auto", 0}} {
		d, n, err := tensor.ParseDevice(c.spec)
		if err != nil || d != c.driver || n != c.ordinal {
			t.Errorf("ParseDevice(%q) = %q, %d, %v; want %q, %d", c.spec, d, n, err, c.driver, c.ordinal)
		}
	}
	for _, spec := range []string{"", ":1", "cuda:", "cuda:x", "cuda:-1", "cuda:+1", "cuda:1:2", "auto:1", "CUDA", "cu da"} {
		if d, n, err := tensor.ParseDevice(spec); err == nil {
			t.Errorf("ParseDevice(%q) = %q, %d; want an error", spec, d, n)
		} else if strings.Contains(err.Error(), "\n") {
			t.Errorf("ParseDevice(%q): error of more than one line: %q", spec, err)
		}
	}
}

func TestOpenDevice(t *testing.T) {
	open := func(spec string, o tensor.DeviceOptions) (tensor.Backend, error) {
		b, err := tensor.OpenDevice(spec, o)
		if err == nil {
			t.Cleanup(func() { b.Close() })
		}
		return b, err
	}
	b, err := open("cpu", tensor.DeviceOptions{Threads: 3})
	if err != nil {
		t.Fatal(err)
	}
	if c, ok := b.(*tensor.CPU); !ok || c.Threads() != 3 {
		t.Errorf(`OpenDevice("cpu", 3 threads) = %T %v`, b, b)
	}
	// Any ordinal of the CPU driver opens a backend of its own.
	b2, err := open("cpu:2", tensor.DeviceOptions{})
	if err != nil || b2 == b {
		t.Errorf(`OpenDevice("cpu:2") = %v, %v; want a second backend`, b2, err)
	}
	for spec, want := range map[string]string{"auto": "zfake:0", "zfake": "zfake:0", "zfake:1": "zfake:1"} {
		b, err := open(spec, tensor.DeviceOptions{})
		if err != nil || b.Name() != want {
			t.Errorf("OpenDevice(%q) = %v, %v; want %s", spec, b, err, want)
		}
	}
	if _, err := open("zfake:2", tensor.DeviceOptions{}); err == nil {
		t.Error(`OpenDevice("zfake:2") of 2 devices succeeded`)
	}
	_, err = open("tpu", tensor.DeviceOptions{})
	if !errors.Is(err, tensor.ErrNoDriver) {
		t.Fatalf(`OpenDevice("tpu"): %v, want ErrNoDriver`, err)
	}
	for _, want := range []string{`"tpu"`, "registered: afail, cpu, zfake", "-tags cuda"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if _, err := open("cpu:x", tensor.DeviceOptions{}); err == nil || errors.Is(err, tensor.ErrNoDriver) {
		t.Errorf(`OpenDevice("cpu:x"): %v, want a malformed-spec error`, err)
	}
}

func TestDevices(t *testing.T) {
	if got, want := tensor.Devices(), []string{"cpu", "zfake:0", "zfake:1"}; !slices.Equal(got, want) {
		t.Errorf("Devices() = %v, want %v", got, want)
	}
	if got, want := tensor.Drivers(), []string{"afail", "cpu", "zfake"}; !slices.Equal(got, want) {
		t.Errorf("Drivers() = %v, want %v", got, want)
	}
}

func TestRegisterDriverRefuses(t *testing.T) {
	for _, name := range []string{"cpu", "auto", "", "Fake", "a:b"} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("RegisterDriver(%q) did not panic", name)
				}
			}()
			tensor.RegisterDriver(name, fakeDriver{})
		}()
	}
}
