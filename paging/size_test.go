package paging

import (
	"fmt"
	"testing"
)

func TestParseSize(t *testing.T) {
	cases := []struct {
		in   string
		want int64
	}{
		{"3.5GiB", 3758096384},
		{"800MiB", 838860800},
		{"4GB", 4000000000},
		{"300000B", 300000},
		{"3.5", 3758096384},
		{"1", 1073741824},
		{" 2 gib ", 2147483648},
		{"512KiB", 524288},
		{"1.5kb", 1500},
		{"1TiB", 1099511627776},
		{"2M", 2097152},
		{"0", 0},
		{"1e3B", 1000},
	}
	for _, c := range cases {
		got, err := ParseSize(c.in)
		if err != nil || got != c.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", c.in, got, err, c.want)
		}
	}
	for _, bad := range []string{"", "GiB", "3.5XB", "-1GiB", "abc", "1..2GiB", "NaN", "1e400"} {
		if got, err := ParseSize(bad); err == nil {
			t.Errorf("ParseSize(%q) = %d, want an error", bad, got)
		}
	}
}

func TestFormatSizeRoundTrip(t *testing.T) {
	for _, n := range []int64{0, 1, 1023, 1024, 1536, 838860800, 3758096384, 5 << 40} {
		s := FormatSize(n)
		back, err := ParseSize(s)
		if err != nil {
			t.Fatalf("FormatSize(%d) = %q does not parse: %v", n, s, err)
		}
		if diff := back - n; diff > n/200 || diff < -n/200 {
			t.Errorf("FormatSize(%d) = %q reads back as %d", n, s, back)
		}
	}
	if got := FormatSize(1536); got != "1.50 KiB" {
		t.Errorf("FormatSize(1536) = %q", got)
	}
}

func TestDeviceFraction(t *testing.T) {
	f := newFake()
	got, err := DeviceFraction(f, 0.25)
	if err != nil || got != 4*GiB {
		t.Fatalf("DeviceFraction(16 GiB, 0.25) = %d, %v", got, err)
	}
	if _, err := DeviceFraction(f, 1.5); err == nil {
		t.Error("fraction 1.5 accepted")
	}
	var nomem struct{ pageableBackend }
	nomem.Memory = noMemInfo{f}
	if _, err := DeviceFraction(nomem, 0.5); err == nil {
		t.Error("backend without MemoryInfo accepted")
	}
}

type noMemInfo struct{ *fakeBackend }

func (noMemInfo) MemInfo() {} // shadows the fake's MemInfo with a different signature

func ExampleParseSize() {
	for _, s := range []string{"3.5GiB", "800MiB", "4GB", "3.5"} {
		n, _ := ParseSize(s)
		fmt.Println(s, n, FormatSize(n))
	}
	// Output:
	// 3.5GiB 3758096384 3.50 GiB
	// 800MiB 838860800 800.00 MiB
	// 4GB 4000000000 3.73 GiB
	// 3.5 3758096384 3.50 GiB
}
