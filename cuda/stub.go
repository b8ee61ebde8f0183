//go:build !cuda

package cuda

import (
	"context"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// This file is the API of a build without the cuda tag: every entry point
// returns ErrNotCompiled, so programs that mention the CUDA backend still
// build and run everywhere and say why there is no GPU.

// Backend is the CUDA backend. Without the cuda build tag none can be
// opened; its methods return ErrNotCompiled.
type Backend struct{}

var (
	_ tensor.Backend         = (*Backend)(nil)
	_ tensor.Syncer          = (*Backend)(nil)
	_ tensor.PinnedAllocator = (*Backend)(nil)
	_ tensor.AsyncUploader   = (*Backend)(nil)
	_ tensor.MemoryInfo      = (*Backend)(nil)
	_ ManagedAllocator       = (*Backend)(nil)
	_ tensor.GradOps         = (*Backend)(nil)
)

// DeviceCount returns ErrNotCompiled.
func DeviceCount() (int, error) { return 0, ErrNotCompiled }

// Available reports false.
func Available() bool { return false }

// Devices returns ErrNotCompiled.
func Devices() ([]DeviceInfo, error) { return nil, ErrNotCompiled }

// Open returns ErrNotCompiled.
func Open(device int) (*Backend, error) { return nil, ErrNotCompiled }

// Name returns "cuda".
func (b *Backend) Name() string { return "cuda" }

// Info returns an empty DeviceInfo.
func (b *Backend) Info() DeviceInfo { return DeviceInfo{} }

// BLAS says that there is no CUDA support.
func (b *Backend) BLAS() string { return ErrNotCompiled.Error() }

// Stats returns zero accounts.
func (b *Backend) Stats() Stats { return Stats{} }

// Trim returns ErrNotCompiled.
func (b *Backend) Trim() (int64, error) { return 0, ErrNotCompiled }

// MemInfo returns ErrNotCompiled.
func (b *Backend) MemInfo() (free, total int64, err error) { return 0, 0, ErrNotCompiled }

// Alloc returns ErrNotCompiled.
func (b *Backend) Alloc(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	return nil, ErrNotCompiled
}

// Free does nothing.
func (b *Backend) Free(t *tensor.Tensor) {}

// Upload returns ErrNotCompiled.
func (b *Backend) Upload(dst *tensor.Tensor, off int64, src []byte) error { return ErrNotCompiled }

// Download returns ErrNotCompiled.
func (b *Backend) Download(dst []byte, src *tensor.Tensor) error { return ErrNotCompiled }

// Sync returns ErrNotCompiled.
func (b *Backend) Sync() error { return ErrNotCompiled }

// AllocPinned returns ErrNotCompiled.
func (b *Backend) AllocPinned(n int64) ([]byte, error) { return nil, ErrNotCompiled }

// FreePinned returns ErrNotCompiled.
func (b *Backend) FreePinned(buf []byte) error { return ErrNotCompiled }

// UploadAsync returns ErrNotCompiled.
func (b *Backend) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (func() error, error) {
	return nil, ErrNotCompiled
}

// AllocManaged returns ErrNotCompiled.
func (b *Backend) AllocManaged(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	return nil, ErrNotCompiled
}

// PrefetchToDevice returns ErrNotCompiled.
func (b *Backend) PrefetchToDevice(t *tensor.Tensor) error { return ErrNotCompiled }

// PrefetchToHost returns ErrNotCompiled.
func (b *Backend) PrefetchToHost(t *tensor.Tensor) error { return ErrNotCompiled }

// AdviseHost returns ErrNotCompiled.
func (b *Backend) AdviseHost(t *tensor.Tensor) error { return ErrNotCompiled }

// AdviseDeviceAccess returns ErrNotCompiled.
func (b *Backend) AdviseDeviceAccess(t *tensor.Tensor) error { return ErrNotCompiled }

// MatMul returns ErrNotCompiled.
func (b *Backend) MatMul(out, x, w, bias *tensor.Tensor) error { return ErrNotCompiled }

// RMSNorm returns ErrNotCompiled.
func (b *Backend) RMSNorm(out, x, w *tensor.Tensor, eps float32) error { return ErrNotCompiled }

// Rope returns ErrNotCompiled.
func (b *Backend) Rope(x *tensor.Tensor, r tensor.Rotary) error {
	return ErrNotCompiled
}

// SiLUMul returns ErrNotCompiled.
func (b *Backend) SiLUMul(out, gate, up *tensor.Tensor) error { return ErrNotCompiled }

// Add returns ErrNotCompiled.
func (b *Backend) Add(out, x, y *tensor.Tensor) error { return ErrNotCompiled }

// Embed returns ErrNotCompiled.
func (b *Backend) Embed(out, table *tensor.Tensor, ids []int32) error { return ErrNotCompiled }

// CopyRows returns ErrNotCompiled.
func (b *Backend) CopyRows(dst *tensor.Tensor, dstRow int, src *tensor.Tensor, srcRow, n int) error {
	return ErrNotCompiled
}

// Attention returns ErrNotCompiled.
func (b *Backend) Attention(out *tensor.Tensor, a tensor.Attn) error {
	return ErrNotCompiled
}

// Argmax returns ErrNotCompiled.
func (b *Backend) Argmax(x *tensor.Tensor) ([]int32, error) { return nil, ErrNotCompiled }

// Cast returns ErrNotCompiled.
func (b *Backend) Cast(dst, src *tensor.Tensor) error { return ErrNotCompiled }

// MatMulPrecise returns ErrNotCompiled.
func (b *Backend) MatMulPrecise(out, x, w, bias *tensor.Tensor) error { return ErrNotCompiled }

// Zero returns ErrNotCompiled.
func (b *Backend) Zero(t *tensor.Tensor) error { return ErrNotCompiled }

// MatMulGradX returns ErrNotCompiled.
func (b *Backend) MatMulGradX(dx, dy, w *tensor.Tensor) error { return ErrNotCompiled }

// MatMulGradW returns ErrNotCompiled.
func (b *Backend) MatMulGradW(dw, dy, x *tensor.Tensor) error { return ErrNotCompiled }

// BiasGrad returns ErrNotCompiled.
func (b *Backend) BiasGrad(db, dy *tensor.Tensor) error { return ErrNotCompiled }

// RMSNormGrad returns ErrNotCompiled.
func (b *Backend) RMSNormGrad(dx, dw, dy, x, w *tensor.Tensor, eps float32) error {
	return ErrNotCompiled
}

// SiLUMulGrad returns ErrNotCompiled.
func (b *Backend) SiLUMulGrad(dgate, dup, dout, gate, up *tensor.Tensor) error {
	return ErrNotCompiled
}

// AttentionGrad returns ErrNotCompiled.
func (b *Backend) AttentionGrad(g tensor.AttnGrad, a tensor.Attn) error {
	return ErrNotCompiled
}

// CrossEntropyGrad returns ErrNotCompiled.
func (b *Backend) CrossEntropyGrad(logits *tensor.Tensor, targets []int32, scale float32) (float64, error) {
	return 0, ErrNotCompiled
}

// Close returns nil: there is nothing to release.
func (b *Backend) Close() error { return nil }

// CopyStats returns zeros.
func (b *Backend) CopyStats() (bytes int64, busy, stall time.Duration) { return 0, 0, 0 }
