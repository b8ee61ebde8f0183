package tensor

import (
	"fmt"
	"runtime"
)

func init() { RegisterDriver("cpu", cpuDriver{}) }

// CPU is the pure-Go backend. Its tensors live in Go memory on the host, and
// its operations run on a persistent pool of worker goroutines created with
// the backend. It is safe for concurrent use; Close stops the workers.
type CPU struct {
	threads int
	pool    *pool
	k       *kernels
}

var (
	_ Backend  = (*CPU)(nil)
	_ RowExact = (*CPU)(nil)
)

// NewCPU returns a CPU backend that computes on threads goroutines;
// threads <= 0 means runtime.NumCPU().
func NewCPU(threads int) *CPU {
	if threads <= 0 {
		threads = runtime.NumCPU()
	}
	c := &CPU{threads: threads, pool: newPool(threads), k: selectKernels()}
	// Stop the workers if the backend is dropped without Close.
	runtime.AddCleanup(c, func(p *pool) { p.close() }, c.pool)
	return c
}

// Name returns "cpu".
func (c *CPU) Name() string { return "cpu" }

// Threads is the number of goroutines an operation is spread over.
func (c *CPU) Threads() int { return c.threads }

// Close stops the worker goroutines. Operations still work after Close but
// run on the calling goroutine only. Close may be called more than once; it
// returns nil.
func (c *CPU) Close() error {
	c.pool.close()
	return nil
}

// Alloc returns a zero-filled host tensor.
func (c *CPU) Alloc(dt DType, shape Shape) (*Tensor, error) {
	n, err := dt.ShapeBytes(shape)
	if err != nil {
		return nil, fmt.Errorf("tensor: cpu: alloc: %w", err)
	}
	if n > maxAllocBytes {
		return nil, fmt.Errorf("tensor: cpu: alloc %v %v: invalid or too large shape", dt, shape)
	}
	return New(dt, shape), nil
}

// maxAllocBytes bounds a single allocation so that absurd shapes are an error
// rather than a runtime crash.
const maxAllocBytes = 1 << 46

// Free drops the tensor's reference to its storage, so that a later use of
// the freed tensor is an error rather than a silent read. Memory is returned
// by the garbage collector once nothing else refers to it.
func (c *CPU) Free(t *Tensor) {
	if t == nil || t.data == nil {
		return
	}
	t.data = nil
}

// Upload copies src into dst's bytes at offset off.
func (c *CPU) Upload(dst *Tensor, off int64, src []byte) error {
	if dst == nil {
		return fmt.Errorf("tensor: cpu: upload: nil tensor")
	}
	if err := onHost("upload", "dst", dst); err != nil {
		return err
	}
	if off < 0 || off > dst.bytes || int64(len(src)) > dst.bytes-off {
		return fmt.Errorf("tensor: cpu: upload: %d bytes at offset %d out of range for %v (%d bytes)", len(src), off, dst, dst.bytes)
	}
	copy(dst.data[off:], src)
	return nil
}

// Download copies src's bytes into dst, which must be exactly as long.
func (c *CPU) Download(dst []byte, src *Tensor) error {
	if src == nil {
		return fmt.Errorf("tensor: cpu: download: nil tensor")
	}
	if err := onHost("download", "src", src); err != nil {
		return err
	}
	if int64(len(dst)) != src.bytes {
		return fmt.Errorf("tensor: cpu: download: buffer of %d bytes for %v (%d bytes)", len(dst), src, src.bytes)
	}
	copy(dst, src.data)
	return nil
}

// onHost returns an error if t's storage is not host memory (a device
// tensor, or one that was freed).
func onHost(op, name string, t *Tensor) error {
	if t.data == nil && t.bytes != 0 {
		return fmt.Errorf("tensor: %s: %s (%v) is not in host memory (a device tensor, or freed)", op, name, t)
	}
	return nil
}

// operands returns an error if any of ts (nil ones aside) is not in host
// memory. It is the one check the CPU's operations make themselves: every
// other rule of their arguments is checked by Checked, in front of them,
// and an operation called with arguments that break those rules may panic.
func operands(op string, ts ...*Tensor) error {
	for _, t := range ts {
		if t != nil && t.data == nil && t.bytes != 0 {
			return fmt.Errorf("tensor: cpu: %s: %v is not in host memory (a device tensor, or freed)", op, t)
		}
	}
	return nil
}

// fvec reads a host float vector (a bias or norm weight) element by element
// in its stored type.
type fvec struct {
	dt  DType
	f32 []float32
	u16 []uint16
}

func newFvec(t *Tensor) fvec {
	if t.dtype == F32 {
		return fvec{dt: F32, f32: t.F32()}
	}
	return fvec{dt: t.dtype, u16: t.U16()}
}

func (v fvec) at(i int) float32 {
	switch v.dt {
	case F16:
		return f16ToF32Table[v.u16[i]]
	case BF16:
		return bf16ToF32(v.u16[i])
	}
	return v.f32[i]
}
