package paging

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/strata-llm/strata/tensor"
)

// Byte multiples understood by ParseSize.
const (
	KiB int64 = 1 << 10
	MiB int64 = 1 << 20
	GiB int64 = 1 << 30
	TiB int64 = 1 << 40
)

var sizeUnits = map[string]float64{
	"b":   1,
	"k":   float64(KiB),
	"kib": float64(KiB),
	"kb":  1e3,
	"m":   float64(MiB),
	"mib": float64(MiB),
	"mb":  1e6,
	"g":   float64(GiB),
	"gib": float64(GiB),
	"gb":  1e9,
	"t":   float64(TiB),
	"tib": float64(TiB),
	"tb":  1e12,
}

// ParseSize parses a byte count such as "3.5GiB", "800MiB", "4GB" or
// "300000B". Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal
// units (KB, MB, GB, TB) powers of 1000; units are case-insensitive and may
// be separated from the number by spaces. A bare number means GiB: "3.5" is
// 3.5 GiB. Fractions of a byte are rounded down.
func ParseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if t == "" {
		return 0, fmt.Errorf("paging: invalid size %q: empty", s)
	}
	i := 0
	for i < len(t) && strings.IndexByte("0123456789.+-eE", t[i]) >= 0 { // no unit starts with e
		i++
	}
	num, unit := t[:i], strings.ToLower(strings.TrimSpace(t[i:]))
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || num == "" {
		return 0, fmt.Errorf("paging: invalid size %q: want a number with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", s)
	}
	mul := float64(GiB)
	if unit != "" {
		m, ok := sizeUnits[unit]
		if !ok {
			return 0, fmt.Errorf("paging: invalid size %q: unknown unit %q", s, t[i:])
		}
		mul = m
	}
	if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, fmt.Errorf("paging: invalid size %q: must be a finite number >= 0", s)
	}
	b := v * mul
	if b >= math.MaxInt64 {
		return 0, fmt.Errorf("paging: invalid size %q: too large", s)
	}
	return int64(b), nil
}

// FormatSize writes n bytes in the largest binary unit that keeps the number
// at least 1, with up to two decimals: 1536 is "1.50 KiB", 300 is "300 B".
// ParseSize reads the result back to within the rounding of the decimals.
func FormatSize(n int64) string {
	neg := n < 0
	u := n
	if neg {
		u = -n
	}
	var s string
	switch {
	case u >= TiB:
		s = fmt.Sprintf("%.2f TiB", float64(u)/float64(TiB))
	case u >= GiB:
		s = fmt.Sprintf("%.2f GiB", float64(u)/float64(GiB))
	case u >= MiB:
		s = fmt.Sprintf("%.2f MiB", float64(u)/float64(MiB))
	case u >= KiB:
		s = fmt.Sprintf("%.2f KiB", float64(u)/float64(KiB))
	default:
		s = fmt.Sprintf("%d B", u)
	}
	if neg {
		return "-" + s
	}
	return s
}

// DeviceFraction returns frac of the device's total memory, as reported by
// a backend that implements tensor.MemoryInfo. It is how a
// -gpu-memory-fraction flag becomes a budget.
func DeviceFraction(b tensor.Memory, frac float64) (int64, error) {
	if !(frac > 0 && frac <= 1) {
		return 0, fmt.Errorf("paging: memory fraction %v: must be in (0, 1]", frac)
	}
	_, total, err := tensor.FreeMemory(b)
	if errors.Is(err, errors.ErrUnsupported) {
		return 0, fmt.Errorf("paging: memory fraction %v: backend %s cannot report its memory size; give the budget in bytes", frac, b.Name())
	}
	if err != nil {
		return 0, fmt.Errorf("paging: memory fraction %v: backend %s: %w", frac, b.Name(), err)
	}
	if total <= 0 {
		return 0, fmt.Errorf("paging: memory fraction %v: backend %s reports %d bytes in total", frac, b.Name(), total)
	}
	return int64(frac * float64(total)), nil
}
