package engine

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// TestCUDACalibratedRates measures, on a GPU host, what the hybrid
// planner predicts a 7B-shape F16 block on the CPU with: MeasureRates'
// rates, then the CPU's calibration over the same pinned copies of the
// block (the fixed cost a block beyond its bytes at the CPU rate, alone
// and beside copies, the attention's rate over an F16 KV cache, with the
// spreads of their repetitions), and a device stage's fixed cost. It logs them with the time they predict for
// one block alone and beside copies, to set against the CPU stage's time
// per block in a bench run (bench: measured_ms_per_token["cpu"] over the
// CPU layers). STRATA_THREADS sets the CPU's threads (default every core).
// It skips without a CUDA device.
func TestCUDACalibratedRates(t *testing.T) {
	gpu, err := tensor.OpenDevice("cuda", tensor.DeviceOptions{})
	if err != nil {
		t.Skipf("no CUDA device: %v", err)
	}
	defer gpu.Close()
	threads, _ := strconv.Atoi(os.Getenv("STRATA_THREADS"))
	cpu := tensor.NewCPU(threads)
	defer cpu.Close()
	for _, preset := range []string{"tinyllama-1.1b", "llama2-7b"} {
		cfg, block := presetBlock(t, preset, tensor.F16)
		var blockBytes int64
		for _, ts := range block {
			blockBytes += ts.Bytes
		}
		t0 := time.Now()
		r, err := MeasureCalibratedRates(context.Background(), gpu, cpu, tensor.F16, cfg, tensor.F16, 8192, block)
		if err != nil {
			t.Fatalf("%s: %v", preset, err)
		}
		took := time.Since(t0)
		alone := float64(blockBytes)/r.CPU*1e3 + float64(r.CPULayer)/1e6
		sharedFixed := r.CPULayerShared
		if sharedFixed == 0 {
			sharedFixed = r.CPULayer
		}
		shared := float64(blockBytes)/r.CPUShared*1e3 + float64(sharedFixed)/1e6
		kvPerPos := float64(2 * 2 * cfg.KVDim())
		t.Logf("%s (%d threads, measured in %v): H2D %.1f GB/s (%.1f beside the CPU), CPU %.1f GB/s (%.1f beside copies), device %.0f GB/s, hand-over %v",
			preset, cpu.Threads(), took.Round(time.Millisecond), r.H2D/1e9, r.H2DShared/1e9, r.CPU/1e9, r.CPUShared/1e9, r.Device/1e9, r.Handoff)
		t.Logf("%s: a block of %.0f MB: %.3f ms fixed besides its bytes (%.3f beside copies); predicted %.2f ms alone (%.1f GB/s), %.2f ms beside copies (%.1f GB/s); attention %.1f GB/s of F16 KV (%.2f ms a block at 8,000 positions)",
			preset, float64(blockBytes)/1e6, float64(r.CPULayer)/1e6, float64(sharedFixed)/1e6, alone, float64(blockBytes)/alone/1e6, shared, float64(blockBytes)/shared/1e6,
			r.CPUAttention/1e9, kvPerPos*8000/max(r.CPUAttention, 1)*1e3)
		t.Logf("%s: fixed cost over the calibration's repetitions (min/median/max): %v alone, %v beside copies", preset, r.CPULayerSpread, r.CPULayerSharedSpread)
		// A device stage: the block on the GPU between a hand-over in
		// and the wait for its queue, less its bytes and a hand-over. The
		// fourth session's 7B runs implied about 0.23 ms a stage
		// (paging's c1DeviceStage); set it against this.
		t.Logf("%s: a device stage %.3f ms besides its block's %.3f ms of bytes at %.0f GB/s (min/median/max %v)",
			preset, float64(r.DeviceStage)/1e6, float64(blockBytes)/r.Device*1e3, r.Device/1e9, r.DeviceStageSpread)
		if r.DeviceStageSpread.N < calibrateMinReps || r.DeviceStage > 5*time.Millisecond {
			t.Errorf("%s: device stage %v (%v)", preset, r.DeviceStage, r.DeviceStageSpread)
		}
		if r.CPULayerSpread.N < calibrateMinReps || r.CPULayerSharedSpread.N < calibrateMinReps {
			t.Errorf("%s: %d repetitions alone, %d beside copies", preset, r.CPULayerSpread.N, r.CPULayerSharedSpread.N)
		}
		if r.CPU <= 0 || r.CPUShared <= 0 || r.H2D <= 0 {
			t.Errorf("%s: rates %+v", preset, r)
		}
		// A block's fixed cost is a small part of its time: a millisecond
		// or two on a 7B block at ~100 GB/s (4 ms of bytes), not tens.
		if r.CPULayer < 0 || r.CPULayer > 20*time.Millisecond {
			t.Errorf("%s: fixed cost %v a block", preset, r.CPULayer)
		}
		// The 7B block's KV at 4,096 positions (64 MiB in F16) is timed:
		// the attention reads it no faster than several times the CPU's
		// rate (caches), and not at a crawl.
		if preset == "llama2-7b" && (r.CPUAttention < 1e9 || r.CPUAttention > 4*r.CPU) {
			t.Errorf("%s: attention %.3g bytes/s against a CPU rate of %.3g", preset, r.CPUAttention, r.CPU)
		}
		// All of it (the rates, the calibration's repetitions alone and
		// beside copies) in about a second; the repetitions take
		// calibrateBudget once each phase has its few.
		if took > 3*time.Second {
			t.Errorf("%s: measuring took %v", preset, took)
		}
	}
}
