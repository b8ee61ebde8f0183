package cuda

import "fmt"

// PDLEnv names the environment variable that turns off programmatic
// dependent launch of a decode step's small kernels (Backend.runStep):
// "0" or "off" launches them as other kernels are; empty, "1" or "on"
// (the default) launches their _pdl twins on compute capability 9.0 and
// newer. The PDL GEMVs (GEMVEnv) are chosen apart.
const PDLEnv = "STRATA_CUDA_PDL"

// pdlSuffix names a kernel's programmatic-dependent-launch twin
// (kernels/step.cuh).
const pdlSuffix = "_pdl"

// FoldEnv names the environment variable that turns off the decode
// step's norms and residual adds folded into its products (normfused.go,
// tensor.NormFuser): "0" or "off" runs them as kernels of their own;
// empty, "1" or "on" (the default) folds them where the PDL GEMVs run,
// norms of up to foldMaxK values; "all" folds norms of any length the
// normed kernels take (gemvNormMaxK).
const FoldEnv = "STRATA_CUDA_FOLD"

// gemvNormMaxK is GEMV_NORM_MAX_K, the longest row the normed kernels
// norm.
const gemvNormMaxK = 8192

// foldMaxK is the longest row whose norm the backend folds by default
// (Backend.foldMaxK): rows of up to 2048 values (TinyLlama's 2048) decode
// faster folded on the H200 (940-951 -> 974-997 tok/s in one call), where
// the 7B's rows of 4096 decode slower (252.5-255.0 -> 242.4-246.3). The
// normed kernels no longer hold a batch of weights through the norm (64
// and 76 registers where they took 99-122; the 7B lost 5.5% before) and
// read x once into shared memory, but each block of a normed grid still
// norms the row after the kernel before it ends, a latency in series
// that the separate norm kernel's PDL overlap hides.
const foldMaxK = 2048

// foldNamed parses FoldEnv's value: whether to fold, and the longest
// norm to fold.
func foldNamed(v string) (bool, int, error) {
	if v == "all" {
		return true, gemvNormMaxK, nil
	}
	on, err := onOffNamed(FoldEnv, v)
	if err != nil {
		return false, 0, fmt.Errorf("%w, or all", err)
	}
	return on, foldMaxK, nil
}

// pdlNamed parses PDLEnv's value.
func pdlNamed(v string) (bool, error) { return onOffNamed(PDLEnv, v) }

// onOffNamed parses the value v of the on/off environment variable env
// (PDLEnv, FoldEnv).
func onOffNamed(env, v string) (bool, error) {
	switch v {
	case "", "1", "on":
		return true, nil
	case "0", "off":
		return false, nil
	}
	return false, fmt.Errorf("cuda: %s=%q: want on or off (1 or 0)", env, v)
}

// stepKernels are the kernels that Backend.runStep launches: each has a
// twin named with pdlSuffix in a module for compute_90 (kernels/step.cuh,
// step_pdl*.cu). TestStepKernelsPDL checks the twins in the committed
// PTX.
var stepKernels = func() []string {
	var k []string
	for _, t := range []string{"f32", "f16", "bf16"} {
		k = append(k, "rmsnorm_"+t, "add_rmsnorm_"+t, "rope_kv_"+t)
	}
	k = append(k, "rope_kv_q8_0", "rope_kv_q8_b8")
	for _, d := range []string{"_d64", "_d128", "_d256"} {
		for _, t := range []string{"f32", "f16", "bf16", "q8_0", "q8_b8"} {
			k = append(k, "attention_split_"+t+d)
		}
		k = append(k, "attention_merge"+d)
	}
	return append(k, "rope_f32_at", "add_f32")
}()
