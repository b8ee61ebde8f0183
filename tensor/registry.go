package tensor

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// The registry of device drivers. A driver opens the devices of one kind
// ("cpu", "cuda"); a device is named by a spec, the driver's name with an
// optional ordinal ("cuda" is "cuda:0"). The CPU driver is always
// registered. Other drivers register themselves from an init function of
// their package, which a program links in with a blank import, e.g.
//
//	import _ "github.com/strata-llm/strata/cuda" // "cuda", with -tags cuda
//
// so that nothing else imports a device package, and a build without a
// device's build tag simply has no driver for it.

// ErrNoDriver is returned (wrapped) by OpenDevice for a spec naming a
// driver that is not registered.
var ErrNoDriver = errors.New("no such device driver")

// DeviceOptions are what a driver is told when it opens a device.
type DeviceOptions struct {
	// Threads is the number of goroutines a CPU device computes on; 0
	// means all cores.
	Threads int
}

// Driver opens the devices of one kind.
type Driver interface {
	// Count returns how many devices the machine has for this driver, or
	// an error saying why there are none it can use.
	Count() (int, error)
	// Open opens device ordinal (0-based).
	Open(ordinal int, o DeviceOptions) (Backend, error)
}

var (
	driversMu sync.Mutex
	drivers   = map[string]Driver{}
)

// RegisterDriver makes a driver available under name, for OpenDevice.
// Drivers register from init functions; a name that is not a plain word of
// lower-case letters and digits, "auto", or a name registered twice
// panics.
func RegisterDriver(name string, d Driver) {
	if !validDriverName(name) || name == "auto" || d == nil {
		panic("tensor: invalid device driver " + strconv.Quote(name))
	}
	driversMu.Lock()
	defer driversMu.Unlock()
	if _, dup := drivers[name]; dup {
		panic("tensor: device driver registered twice: " + name)
	}
	drivers[name] = d
}

func validDriverName(name string) bool {
	if name == "" {
		return false
	}
	for _, r := range name {
		if !('a' <= r && r <= 'z' || '0' <= r && r <= '9') {
			return false
		}
	}
	return true
}

// Drivers lists the registered drivers' names, sorted.
func Drivers() []string {
	driversMu.Lock()
	defer driversMu.Unlock()
	names := make([]string, 0, len(drivers))
	for n := range drivers {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

func driver(name string) (Driver, bool) {
	driversMu.Lock()
	defer driversMu.Unlock()
	d, ok := drivers[name]
	return d, ok
}

// ParseDevice splits a device spec into its driver's name and the device's
// ordinal: "cpu" and "cuda" are device 0 of their driver, "cuda:1" is
// device 1, and "auto" is returned as driver "auto", device 0. It checks
// only the form of the spec, not that the driver is registered.
func ParseDevice(spec string) (driver string, ordinal int, err error) {
	name, num, hasNum := strings.Cut(spec, ":")
	if !validDriverName(name) {
		return "", 0, fmt.Errorf("tensor: device %q: want auto, or a driver's name with an optional :ordinal (cpu, cuda, cuda:1)", spec)
	}
	if !hasNum {
		return name, 0, nil
	}
	if name == "auto" {
		return "", 0, fmt.Errorf("tensor: device %q: auto takes no ordinal", spec)
	}
	n, err := strconv.Atoi(num)
	if err != nil || n < 0 || strings.HasPrefix(num, "+") {
		return "", 0, fmt.Errorf("tensor: device %q: ordinal %q is not a device number", spec, num)
	}
	return name, n, nil
}

// OpenDevice opens the device a spec names (see ParseDevice). "auto" opens
// device 0 of the first driver other than the CPU's, by name, that has a
// device and opens it, and the CPU otherwise. A spec naming a driver that
// is not registered is an error wrapping ErrNoDriver that lists those that
// are.
func OpenDevice(spec string, o DeviceOptions) (Backend, error) {
	name, ordinal, err := ParseDevice(spec)
	if err != nil {
		return nil, err
	}
	if name == "auto" {
		for _, n := range Drivers() {
			if n == "cpu" {
				continue
			}
			d, _ := driver(n)
			if c, err := d.Count(); err != nil || c == 0 {
				continue
			}
			if b, err := d.Open(0, o); err == nil {
				return b, nil
			}
		}
		name = "cpu"
	}
	d, ok := driver(name)
	if !ok {
		return nil, fmt.Errorf("tensor: device %q: %w %q (registered: %s; a GPU driver needs its build tag, e.g. -tags cuda)",
			spec, ErrNoDriver, name, strings.Join(Drivers(), ", "))
	}
	return d.Open(ordinal, o)
}

// Devices lists the devices the machine has, by spec: "cpu", then
// "cuda:0", "cuda:1", ... for each other registered driver, by name. A
// driver that cannot count its devices adds none.
func Devices() []string {
	out := []string{"cpu"}
	for _, n := range Drivers() {
		if n == "cpu" {
			continue
		}
		d, _ := driver(n)
		c, err := d.Count()
		if err != nil {
			continue
		}
		for i := range c {
			out = append(out, n+":"+strconv.Itoa(i))
		}
	}
	return out
}

// cpuDriver opens CPU backends. Every ordinal opens an independent
// backend, so that CPU backends can stand in for several devices (in
// tests of pipelines over devices, say); Count reports one.
type cpuDriver struct{}

func (cpuDriver) Count() (int, error) { return 1, nil }

func (cpuDriver) Open(ordinal int, o DeviceOptions) (Backend, error) {
	if ordinal < 0 {
		return nil, fmt.Errorf("tensor: cpu: device %d does not exist", ordinal)
	}
	return NewCPU(o.Threads), nil
}
