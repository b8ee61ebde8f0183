package tensor

import (
	"fmt"
	"math"
	"strings"
)

// Shape lists a tensor's dimensions, outermost first (row-major).
type Shape []int

// NumElements is the product of the dimensions; 1 for a scalar (empty shape).
// It returns -1 if a dimension is negative or the product overflows int64.
func (s Shape) NumElements() int64 {
	n := int64(1)
	for _, d := range s {
		if d < 0 {
			return -1
		}
		if d != 0 && n > math.MaxInt64/int64(d) {
			return -1
		}
		n *= int64(d)
	}
	return n
}

// Equal reports whether s and t have the same dimensions.
func (s Shape) Equal(t Shape) bool {
	if len(s) != len(t) {
		return false
	}
	for i := range s {
		if s[i] != t[i] {
			return false
		}
	}
	return true
}

// Clone returns a copy of s that does not share its backing array.
func (s Shape) Clone() Shape { return append(Shape(nil), s...) }

func (s Shape) String() string {
	parts := make([]string, len(s))
	for i, d := range s {
		parts[i] = fmt.Sprint(d)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}
