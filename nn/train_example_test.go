package nn_test

import (
	"context"
	"fmt"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/tensor"
)

// Fine-tuning the tiny F16 fixture on its own prompt: F16 weights with an
// F32 master copy, a dynamic loss scale, AdamW and two recompute
// checkpoints.
func ExampleCheckpointSequential() {
	ctx := context.Background()
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		panic(err)
	}
	defer lm.Close()
	cfg := lm.Config
	params, err := nn.LoadParams(ctx, lm) // F16 working copies, F32 masters
	if err != nil {
		panic(err)
	}
	cpu := tensor.NewCPU(0)
	defer cpu.Close()
	model, err := nn.New(cfg, cpu, nil, params)
	if err != nil {
		panic(err)
	}
	trainer, err := nn.CheckpointSequential(model, 2)
	if err != nil {
		panic(err)
	}
	inputs, targets := nn.NextToken([]int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3})
	opt, scaler := nn.NewAdamW(1e-2), nn.NewLossScaler(65536, 100)
	var first, last nn.StepResult
	for step := range 10 {
		r, err := trainer.Step(ctx, inputs, targets, params, opt, scaler)
		if err != nil {
			panic(err)
		}
		if step == 0 {
			first = r
		}
		last = r
	}
	fmt.Println("recomputed blocks per step:", last.RecomputedBlocks)
	fmt.Println("loss fell below half:", last.Loss < first.Loss/2)
	// Output:
	// recomputed blocks per step: 2
	// loss fell below half: true
}
