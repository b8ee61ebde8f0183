package tensor

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/x448/float16"
)

// refNonFinite is the reference: convert each element to float64 with a
// conversion that does not share FirstNonFinite's code, and ask math.
func refNonFinite(dt DType, data []byte) int {
	for i := 0; (i+1)*dt.Size() <= len(data); i++ {
		var v float64
		switch dt {
		case F16:
			v = float64(float16.Frombits(binary.LittleEndian.Uint16(data[2*i:])).Float32())
		case BF16:
			v = float64(math.Float32frombits(uint32(binary.LittleEndian.Uint16(data[2*i:])) << 16))
		case F32:
			v = float64(math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:])))
		default:
			return -1
		}
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return i
		}
	}
	return -1
}

var floatDTypes = []DType{F16, BF16, F32}

// specials are, per dtype, bit patterns at the edges of the finite range:
// zeros, the smallest and largest subnormals, the smallest normal, the
// largest finite values, and non-finite ones.
var specials = map[DType][]uint32{
	F16:  {0x0000, 0x8000, 0x0001, 0x03ff, 0x8001, 0x0400, 0x7bff, 0xfbff, 0x3c00, 0x7c00, 0xfc00, 0x7c01, 0x7e00, 0x7fff, 0xfe00, 0xffff},
	BF16: {0x0000, 0x8000, 0x0001, 0x007f, 0x8001, 0x0080, 0x7f7f, 0xff7f, 0x3f80, 0x7f80, 0xff80, 0x7f81, 0x7fc0, 0x7fff, 0xffc0, 0xffff},
	F32: {0, 0x80000000, 1, 0x007fffff, 0x80000001, 0x00800000, 0x7f7fffff, 0xff7fffff, 0x3f800000,
		0x7f800000, 0xff800000, 0x7f800001, 0x7fc00000, 0x7fffffff, 0xffc00000, 0xffffffff, 0xff800001},
}

func put(dt DType, data []byte, i int, bits uint32) {
	if dt.Size() == 2 {
		binary.LittleEndian.PutUint16(data[2*i:], uint16(bits))
	} else {
		binary.LittleEndian.PutUint32(data[4*i:], bits)
	}
}

// finiteBits returns a random finite bit pattern of dt, subnormals and
// the largest exponent below the non-finite one included.
func finiteBits(dt DType, r *rand.Rand) uint32 {
	for {
		var b uint32
		if dt.Size() == 2 {
			b = uint32(r.Uint32N(1 << 16))
		} else {
			b = r.Uint32()
		}
		var buf [4]byte
		put(dt, buf[:], 0, b)
		if refNonFinite(dt, buf[:dt.Size()]) < 0 {
			return b
		}
	}
}

func checkNonFinite(t *testing.T, dt DType, data []byte) {
	t.Helper()
	if got, want := FirstNonFinite(dt, data), refNonFinite(dt, data); got != want {
		t.Fatalf("%v over %d bytes: FirstNonFinite %d, reference %d", dt, len(data), got, want)
	}
}

// TestFirstNonFiniteEveryPattern places every 16-bit pattern (for F32,
// every special one and random ones of each exponent) at every position
// of a word, in a block, in the tail and after an earlier hit, among
// random finite values.
func TestFirstNonFiniteEveryPattern(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, dt := range floatDTypes {
		var patterns []uint32
		if dt.Size() == 2 {
			for b := range 1 << 16 {
				patterns = append(patterns, uint32(b))
			}
		} else {
			patterns = append(patterns, specials[F32]...)
			for e := range uint32(256) {
				for range 8 {
					patterns = append(patterns, r.Uint32()&0x807fffff|e<<23)
				}
			}
		}
		n := 96 / dt.Size() // a 64-byte block and a 32-byte tail
		data := make([]byte, n*dt.Size())
		for i := range n {
			put(dt, data, i, finiteBits(dt, r))
		}
		if got := FirstNonFinite(dt, data); got != -1 {
			t.Fatalf("%v: finite data gives %d", dt, got)
		}
		positions := []int{0, 1, 2, 3, 5, n/2 - 1, n/2 + 1, n - 2, n - 1}
		for _, b := range patterns {
			p := positions[int(b)%len(positions)]
			var old [4]byte
			copy(old[:], data[p*dt.Size():])
			put(dt, data, p, b)
			checkNonFinite(t, dt, data)
			copy(data[p*dt.Size():], old[:dt.Size()])
		}
	}
}

// TestFirstNonFiniteRandom compares with the reference on random bit
// patterns of every length up to 300 bytes, odd lengths included, with
// non-finite values made rare enough that long clean runs occur.
func TestFirstNonFiniteRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, dt := range append(floatDTypes, I32, I64) {
		for n := range 300 {
			data := make([]byte, n)
			for i := 0; i+dt.Size() <= n && dt.IsFloat(); i += dt.Size() {
				b := finiteBits(dt, r)
				if r.IntN(50) == 0 {
					s := specials[dt]
					b = s[r.IntN(len(s))]
				}
				put(dt, data, i/dt.Size(), b)
			}
			if !dt.IsFloat() {
				for i := range data {
					data[i] = 0xff
				}
			}
			checkNonFinite(t, dt, data)
			// From an odd start, for the loader's ranges.
			if n > 1 {
				checkNonFinite(t, dt, data[1:])
			}
		}
	}
}

func TestIsNonFiniteAndElementF64(t *testing.T) {
	for _, dt := range floatDTypes {
		for _, b := range specials[dt] {
			var buf [4]byte
			put(dt, buf[:], 0, b)
			v := ElementF64(dt, buf[:], 0)
			if want := math.IsNaN(v) || math.IsInf(v, 0); IsNonFinite(dt, buf[:]) != want {
				t.Errorf("%v %#x: IsNonFinite %v, value %v", dt, b, !want, v)
			}
		}
	}
	if IsNonFinite(I32, []byte{0xff, 0xff, 0xff, 0xff}) {
		t.Error("an I32 is not finite")
	}
}

// FuzzNonFinite compares FirstNonFinite with the reference for every
// float dtype on arbitrary bytes.
func FuzzNonFinite(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{0x00, 0x7c})
	f.Add(make([]byte, 130))
	b := make([]byte, 200)
	binary.LittleEndian.PutUint32(b[140:], 0x7f800000)
	f.Add(b)
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, dt := range floatDTypes {
			checkNonFinite(t, dt, data)
		}
	})
}

// BenchmarkFirstNonFinite checks 1 MiB of finite values (as after one read
// piece, in cache) and 64 MiB (from memory).
func BenchmarkFirstNonFinite(b *testing.B) {
	for _, size := range []int{1 << 20, 64 << 20} {
		for _, dt := range floatDTypes {
			data := make([]byte, size)
			for i := 0; i < size/dt.Size(); i++ {
				put(dt, data, i, uint32(i%1000)|0x3000)
			}
			b.Run(fmt.Sprintf("%v/%dMiB", dt, size>>20), func(b *testing.B) {
				for b.Loop() {
					if FirstNonFinite(dt, data) != -1 {
						b.Fatal("finite data flagged")
					}
				}
				b.ReportMetric(float64(size)*float64(b.N)/1e9/b.Elapsed().Seconds(), "GB/s")
			})
		}
	}
}
