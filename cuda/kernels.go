//go:build cuda

package cuda

import (
	"embed"
	"errors"
	"fmt"
	"path"
	"sort"
	"strings"

	"gorgonia.org/cu"
)

// The kernels, compiled from kernels/*.cu to PTX for compute_70 by make
// cuda-ptx and committed, so that a machine with only the driver runs them:
// the driver compiles the PTX for the GPU at hand when it loads it. A few
// (the tensor-core attention, flash_attention_*.ptx) target compute_80;
// their modules are loaded only on devices that have it, and the
// operations that use them fall back to other kernels elsewhere.
//
//go:embed kernels/*.ptx
var ptxFS embed.FS

// Driver results that mean "this driver cannot compile or run this PTX".
var ptxLoadCodes = map[int]bool{
	200: true, // CUDA_ERROR_INVALID_IMAGE
	209: true, // CUDA_ERROR_NO_BINARY_FOR_GPU
	218: true, // CUDA_ERROR_INVALID_PTX
	221: true, // CUDA_ERROR_JIT_COMPILER_NOT_FOUND
	222: true, // CUDA_ERROR_UNSUPPORTED_PTX_VERSION
}

// loadKernels loads every embedded module and indexes its kernels by name.
// The context must be current.
func (b *Backend) loadKernels() error {
	names, err := ptxFS.ReadDir("kernels")
	if err != nil {
		return fmt.Errorf("cuda: reading the embedded kernels: %v", err)
	}
	sort.Slice(names, func(i, j int) bool { return names[i].Name() < names[j].Name() })
	for _, e := range names {
		file := path.Join("kernels", e.Name())
		data, err := ptxFS.ReadFile(file)
		if err != nil {
			return fmt.Errorf("cuda: reading %s: %v", file, err)
		}
		ptx := string(data)
		if target := ptxTarget(ptx); target > 10*b.info.Major+b.info.Minor {
			continue // a newer device's kernels (optionalKernels)
		}
		isa, need, verr := ptxNeeds(ptx)
		if verr != nil {
			return fmt.Errorf("cuda: %s: %v", file, verr)
		}
		have := b.info.DriverVersion
		if need > 0 && have > 0 && have < need {
			return fmt.Errorf("cuda: no kernel image for this device: %s is PTX ISA %s, which needs a driver for CUDA %s or newer; "+
				"this driver supports CUDA %s: %w", file, isa, versionString(need), versionString(have), ErrDriverTooOld)
		}
		m, log, err := loadModule(ptx)
		if err != nil {
			var de *DriverError
			if errors.As(err, &de) && ptxLoadCodes[de.Code] {
				return fmt.Errorf("cuda: no kernel image for this device: loading %s (PTX ISA %s, needs a driver for CUDA %s or newer; "+
					"this driver supports CUDA %s; device %s, compute capability %d.%d): %w: %s: %w",
					file, isa, versionString(need), versionString(have), b.info.Name, b.info.Major, b.info.Minor, err, strings.TrimSpace(log), ErrDriverTooOld)
			}
			return fmt.Errorf("cuda: loading %s: %v %s", file, err, strings.TrimSpace(log))
		}
		b.modules = append(b.modules, m)
		for _, name := range ptxEntries(ptx) {
			f, err := moduleFunction(m, name)
			if err != nil {
				return fmt.Errorf("cuda: %s: kernel %s: %v", file, name, err)
			}
			b.kernels[name] = f
		}
	}
	for _, name := range requiredKernels {
		if _, ok := b.kernels[name]; !ok {
			return fmt.Errorf("cuda: the embedded PTX lacks kernel %s; run make cuda-ptx", name)
		}
	}
	return nil
}

var requiredKernels = func() []string {
	var k []string
	for _, t := range []string{"f32", "f16", "bf16"} {
		k = append(k, "rmsnorm_"+t, "bias_add_"+t, "embed_"+t, "attention_"+t, "gemm_"+t,
			"gemv_"+t+"_m1", "gemv_"+t+"_m2", "gemv_"+t+"_m4", "gemv_"+t+"_any")
	}
	for _, t := range []string{"f32", "f16", "bf16", "q8_0", "q8_b8"} {
		for _, d := range []string{"_d64", "_d128", "_d256"} {
			k = append(k, "attention_split_"+t+d)
		}
	}
	for _, t := range []string{"q8_0", "q8_b8"} {
		k = append(k, "attention_"+t, "attention_"+t+"_at", "kv_append_"+t, "rope_kv_"+t)
	}
	k = append(k, "attention_merge_d64", "attention_merge_d128", "attention_merge_d256")
	// The fused and graph kernels (fused.go, graph.go; kernels/fused.cu).
	for _, t := range []string{"f32", "f16", "bf16"} {
		k = append(k, "add_rmsnorm_"+t, "rope_kv_"+t, "attention_"+t+"_at", "gemv_gate_up_"+t+"_m1", "gemv_gate_up_"+t+"_m2", "gemv_"+t+"_r1", "gemv_"+t+"_r2", "gemv_many_"+t)
	}
	// The candidate decode GEMVs (gemvsplit.go; kernels/gemv_split.cuh).
	for _, t := range []string{"f16", "bf16"} {
		for i := range gemvVariants {
			if !gemvVariants[i].pdl { // pdlKernels
				k = append(k, gemvVariants[i].kernel(t), gemvVariants[i].gateUpKernel(t))
			}
		}
	}
	for _, t := range []string{"f32", "f16", "bf16", "q8_0", "q8_b8"} {
		k = append(k, "kv_write_blocks_"+t, "attention_blocks_"+t)
	}
	k = append(k, "rope_f32_at", "rope_f32", "rope_rows_f32", "silu_mul_f32", "add_f32", "cast_f32_f16", "cast_f32_bf16", "split_f32_bf16", "cast_f16_f32", "cast_bf16_f32", "argmax_f32")
	// The backward kernels (grad.go; kernels/grad.cu, kernels/attention_grad*).
	for _, t := range []string{"f32", "f16", "bf16"} {
		k = append(k, "rmsnorm_grad_"+t, "gemm_grad_x_"+t)
	}
	for _, d := range []string{"_d64", "_d128", "_d256"} {
		k = append(k, "attention_grad_q_f32"+d, "attention_grad_kv_f32"+d)
	}
	k = append(k, "rmsnorm_grad_w_f32", "bias_grad_f32", "silu_mul_grad_f32", "cross_entropy_grad_f32", "gemm_grad_w_f32")
	// The quantized weights' kernels (quant.go; kernels/quant.cuh).
	for _, f := range quantFormats {
		k = append(k, "gemv_"+f.name+"_m1", "gemv_"+f.name+"_m2", "dequant_"+f.name+"_f32", "dequant_"+f.name+"_f16")
		for _, mm := range []string{"1", "2", "4", "8"} {
			k = append(k, "gemvx_"+f.name+"_m"+mm)
		}
	}
	k = append(k, "quantx16")
	return k
}()

// run launches kernel name on the compute stream. The caller holds opsMu
// and has entered the context.
func (b *Backend) run(name string, grid, block [3]uint32, a *args) error {
	return b.runShared(name, grid, block, 0, a)
}

// runShared launches kernel name with shmem bytes of dynamic shared memory,
// opting the kernel in first when that is more than the default 48 KiB.
// The caller holds opsMu and has entered the context.
func (b *Backend) runShared(name string, grid, block [3]uint32, shmem int, a *args) error {
	f, ok := b.kernels[name]
	if !ok {
		return fmt.Errorf("%s: no kernel %s", b.name, name)
	}
	if shmem > 48<<10 {
		if err := setMaxShared(f, shmem); err != nil {
			return fmt.Errorf("%s: %s: allowing %d bytes of shared memory: %w", b.name, name, shmem, err)
		}
	}
	b.counts.kernels.Add(1)
	if err := launch(f, grid, block, uint32(shmem), b.compute, a); err != nil {
		return fmt.Errorf("%s: launching %s: %w", b.name, name, err)
	}
	return nil
}

// runPDL launches kernel name as run does, with programmatic dependent
// launch allowed (a _pdl kernel, which waits for the kernel before it
// itself). The caller holds opsMu and has entered the context.
func (b *Backend) runPDL(name string, grid, block [3]uint32, a *args) error {
	f, ok := b.kernels[name]
	if !ok {
		return fmt.Errorf("%s: no kernel %s", b.name, name)
	}
	b.counts.kernels.Add(1)
	if err := launchPDL(f, grid, block, b.compute, a); err != nil {
		return fmt.Errorf("%s: launching %s: %w", b.name, name, err)
	}
	return nil
}

// runStep launches a kernel of a decode step (stepKernels) as run does,
// or, where the backend launches them so (pdl), its twin with
// programmatic dependent launch: the twin lets the next kernel launch
// from its start and waits for the one before it (kernels/step.cuh), so
// that one kernel's launch and ramp overlap the other's end. The caller
// holds opsMu and has entered the context.
func (b *Backend) runStep(name string, grid, block [3]uint32, a *args) error {
	if _, ok := b.kernels[name+pdlSuffix]; ok && b.pdl {
		b.pdlLaunches.Add(1)
		return b.runPDL(name+pdlSuffix, grid, block, a)
	}
	return b.run(name, grid, block, a)
}

// run1D launches an elementwise kernel over n items with a grid-stride
// loop.
func (b *Backend) run1D(name string, n int64, a *args) error {
	return b.run(name, grid1D(b, n), [3]uint32{threads1D, 1, 1}, a)
}

// runStep1D launches a decode step's elementwise kernel as run1D does,
// through runStep.
func (b *Backend) runStep1D(name string, n int64, a *args) error {
	return b.runStep(name, grid1D(b, n), [3]uint32{threads1D, 1, 1}, a)
}

// threads1D is the block size of run1D's grid-stride kernels.
const threads1D = 256

// grid1D is run1D's grid for n items: a block per threads1D items, at
// most 16 a multiprocessor.
func grid1D(b *Backend, n int64) [3]uint32 {
	blocks := (n + threads1D - 1) / threads1D
	blocks = min(blocks, int64(b.info.SMs)*16)
	return [3]uint32{uint32(max(blocks, 1)), 1, 1}
}

// memsetAsync zeroes n bytes at p on the compute stream.
func (b *Backend) memsetAsync(p uintptr, n int64) error {
	b.counts.copies.Add(1)
	if err := cu.MemsetD8Async(cu.DevicePtr(p), 0, n, b.compute); err != nil {
		return fmt.Errorf("%s: memset: %w", b.name, cuError(err))
	}
	return nil
}

// optionalKernels are the kernels of modules that need a newer device than
// compute capability 7.0 (a genptx-arch line in their source): the
// tensor-core prefill attention, for compute capability 8.0 and newer.
var optionalKernels = func() []string {
	var k []string
	for _, t := range []string{"f32", "f16", "bf16", "q8_0", "q8_b8"} {
		k = append(k, "flash_attention_"+t+"_d64", "flash_attention_"+t+"_d128")
	}
	return k
}()
