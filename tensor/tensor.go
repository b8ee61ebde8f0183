package tensor

import (
	"fmt"
	"unsafe"
)

// Tensor is a dense, row-major array of one DType. Its storage is either host
// memory (Bytes is non-nil) or memory owned by a Backend (Ptr is non-zero and
// Bytes may be nil). A Tensor does not own a device allocation: the backend
// that made it frees it.
type Tensor struct {
	dtype DType
	shape Shape
	data  []byte  // host storage, little-endian; nil for device tensors
	ptr   uintptr // device address; 0 for host tensors
	bytes int64
}

// New returns a zero-filled host tensor.
func New(dt DType, shape Shape) *Tensor {
	n, err := dt.ShapeBytes(shape)
	if err != nil {
		panic(fmt.Sprintf("tensor: invalid tensor %v %v: %v", dt, shape, err))
	}
	return &Tensor{dtype: dt, shape: shape.Clone(), data: make([]byte, n), bytes: n}
}

// FromBytes wraps host bytes without copying. len(b) must equal the tensor's
// byte size.
func FromBytes(dt DType, shape Shape, b []byte) (*Tensor, error) {
	n, err := dt.ShapeBytes(shape)
	if err != nil {
		return nil, err
	}
	if int64(len(b)) != n {
		return nil, fmt.Errorf("tensor: %v %v needs %d bytes, got %d", dt, shape, n, len(b))
	}
	return &Tensor{dtype: dt, shape: shape.Clone(), data: b, bytes: int64(len(b))}, nil
}

// FromF32 wraps a float32 slice without copying.
func FromF32(shape Shape, v []float32) (*Tensor, error) {
	return FromBytes(F32, shape, f32Bytes(v))
}

// NewDevice describes backend-owned memory at address ptr. Backends call it;
// the tensor has no host storage.
func NewDevice(dt DType, shape Shape, ptr uintptr) *Tensor {
	n, _ := dt.ShapeBytes(shape) // the backend checked it when it allocated
	return &Tensor{dtype: dt, shape: shape.Clone(), ptr: ptr, bytes: n}
}

// DType returns the element type.
func (t *Tensor) DType() DType { return t.dtype }

// Shape returns the dimensions. Callers must not modify it.
func (t *Tensor) Shape() Shape { return t.shape }

// Len is the number of elements.
func (t *Tensor) Len() int { return int(t.shape.NumElements()) }

// NumBytes is the size of the storage in bytes.
func (t *Tensor) NumBytes() int64 { return t.bytes }

// Bytes returns the host storage, or nil for a device tensor.
func (t *Tensor) Bytes() []byte { return t.data }

// Ptr returns the device address, or 0 for a host tensor.
func (t *Tensor) Ptr() uintptr { return t.ptr }

// OnHost reports whether the tensor's storage is host memory.
func (t *Tensor) OnHost() bool { return t.data != nil || t.bytes == 0 }

// Reshape returns a tensor sharing t's storage with another shape of the same
// element count; a quantized tensor's rows must stay whole blocks.
func (t *Tensor) Reshape(shape Shape) (*Tensor, error) {
	if shape.NumElements() != int64(t.Len()) {
		return nil, fmt.Errorf("tensor: cannot reshape %v to %v", t.shape, shape)
	}
	if t.dtype.BlockSize() > 1 && (len(shape) == 0 || shape[len(shape)-1]%t.dtype.BlockSize() != 0) {
		return nil, fmt.Errorf("tensor: cannot reshape %v %v to %v: a row is not whole blocks of %d", t.dtype, t.shape, shape, t.dtype.BlockSize())
	}
	u := *t
	u.shape = shape.Clone()
	return &u, nil
}

// F32 views a host F32 tensor as []float32 without copying. It panics if t is
// not a host F32 tensor: that is a programming error, not bad input.
func (t *Tensor) F32() []float32 {
	t.mustHost(F32)
	if len(t.data) == 0 {
		return nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&t.data[0])), len(t.data)/4)
}

// U16 views a host F16 or BF16 tensor as raw 16-bit words.
func (t *Tensor) U16() []uint16 {
	if t.dtype != F16 && t.dtype != BF16 {
		panic(fmt.Sprintf("tensor: U16 of %v tensor", t.dtype))
	}
	t.mustHost(t.dtype)
	if len(t.data) == 0 {
		return nil
	}
	return unsafe.Slice((*uint16)(unsafe.Pointer(&t.data[0])), len(t.data)/2)
}

// I32 views a host I32 tensor as []int32.
func (t *Tensor) I32() []int32 {
	t.mustHost(I32)
	if len(t.data) == 0 {
		return nil
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(&t.data[0])), len(t.data)/4)
}

// I64 views a host I64 tensor as []int64.
func (t *Tensor) I64() []int64 {
	t.mustHost(I64)
	if len(t.data) == 0 {
		return nil
	}
	return unsafe.Slice((*int64)(unsafe.Pointer(&t.data[0])), len(t.data)/8)
}

func (t *Tensor) mustHost(dt DType) {
	if t.dtype != dt {
		panic(fmt.Sprintf("tensor: %v view of %v tensor", dt, t.dtype))
	}
	if t.data == nil && t.bytes != 0 {
		panic("tensor: host view of a device tensor")
	}
}

// ToF32 returns the values of a host float tensor converted to float32
// (a copy, or a view when t is already F32).
func (t *Tensor) ToF32() []float32 {
	switch t.dtype {
	case F32:
		return t.F32()
	case F16:
		out := make([]float32, t.Len())
		F16ToF32(out, t.U16())
		return out
	case BF16:
		out := make([]float32, t.Len())
		BF16ToF32(out, t.U16())
		return out
	}
	panic(fmt.Sprintf("tensor: ToF32 of %v tensor", t.dtype))
}

func (t *Tensor) String() string {
	where := "host"
	if !t.OnHost() {
		where = fmt.Sprintf("device@%#x", t.ptr)
	}
	return fmt.Sprintf("Tensor(%v %v %s)", t.dtype, t.shape, where)
}

func f32Bytes(v []float32) []byte {
	if len(v) == 0 {
		return []byte{}
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), len(v)*4)
}

// Rows returns a view of n rows of t starting at row start, sharing t's
// storage (host bytes or device address). A row is the product of all but
// the first dimension. The view must not be freed; free t.
func (t *Tensor) Rows(start, n int) (*Tensor, error) {
	if len(t.shape) == 0 || start < 0 || n < 0 || start+n > t.shape[0] {
		return nil, fmt.Errorf("tensor: rows %d..%d of %v", start, start+n, t.shape)
	}
	rowBytes := int64(0)
	if t.shape[0] > 0 {
		rowBytes = t.bytes / int64(t.shape[0])
	}
	u := *t
	u.shape = append(Shape{n}, t.shape[1:]...)
	u.bytes = rowBytes * int64(n)
	off := rowBytes * int64(start)
	if t.data != nil {
		u.data = t.data[off : off+u.bytes : off+u.bytes]
	} else if t.ptr != 0 {
		u.ptr = t.ptr + uintptr(off)
	}
	return &u, nil
}

// View returns a tensor of dtype dt and shape shape over t's storage
// starting at byte offset off: how a slab allocated once (a streaming ring)
// hands out tensors without allocating. The view must fit inside t, must
// not be freed (free t), and is valid only while t is. Backends that read
// with wide loads want off aligned (256 bytes serves every kernel).
func (t *Tensor) View(off int64, dt DType, shape Shape) (*Tensor, error) {
	bytes, err := dt.ShapeBytes(shape)
	if err != nil {
		return nil, fmt.Errorf("tensor: invalid view: %w", err)
	}
	if off < 0 || off > t.bytes || bytes > t.bytes-off {
		return nil, fmt.Errorf("tensor: view of %d bytes at offset %d exceeds the %d bytes of %v", bytes, off, t.bytes, t)
	}
	u := &Tensor{dtype: dt, shape: shape.Clone(), bytes: bytes}
	if t.data != nil {
		u.data = t.data[off : off+bytes : off+bytes]
	} else if t.ptr != 0 {
		u.ptr = t.ptr + uintptr(off)
	}
	return u, nil
}
