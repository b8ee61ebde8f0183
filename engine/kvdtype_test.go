package engine

import (
	"context"
	"fmt"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// TestKVDType opens the F16 fixture with the KV cache in each dtype on one
// device and as a pipeline over two: the plans count the dtype's bytes
// for the context, the two placements give the same logits (the same
// arithmetic on each block), and a dtype the model cannot store its cache
// in is refused by Open.
func TestKVDType(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	const ctxLen, chunk = 24, 8
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}
	// 4 blocks, K and V, 32 values a position.
	rowBytes := map[tensor.DType]int64{tensor.F32: 128, tensor.F16: 64, tensor.BF16: 64, tensor.Q8_0: 34, tensor.Q8_B8: 40}
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.Q8_0, tensor.Q8_B8} {
		var logits [2][]float32
		for i, devices := range []int{1, 2} {
			t.Run(fmt.Sprintf("%v/%d devices", dt, devices), func(t *testing.T) {
				e, err := Open(context.Background(), lm, Options{Backends: cpus(devices), Context: ctxLen, Chunk: chunk, Memory: Memory{KVDType: dt}})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				if e.KVDType() != dt {
					t.Errorf("KVDType %v, want %v", e.KVDType(), dt)
				}
				var kv int64
				for _, d := range e.Devices() {
					kv += d.Plan.KVCacheBytes
				}
				if want := 2 * 4 * ctxLen * rowBytes[dt]; kv != want {
					t.Errorf("plans' KV cache %d bytes, want %d", kv, want)
				}
				s, err := e.NewSession()
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				if logits[i], err = s.Forward(context.Background(), prompt, true, nil); err != nil {
					t.Fatal(err)
				}
			})
		}
		if len(logits[0]) == 0 || len(logits[0]) != len(logits[1]) {
			t.Fatalf("%v: logits of %d and %d values", dt, len(logits[0]), len(logits[1]))
		}
		for i := range logits[0] {
			if logits[0][i] != logits[1][i] {
				t.Fatalf("%v: logit %d is %v on one device, %v on two", dt, i, logits[0][i], logits[1][i])
			}
		}
	}
	if _, err := Open(context.Background(), lm, Options{Backends: cpus(1), Context: ctxLen, Memory: Memory{KVDType: tensor.Q4_0}}); err == nil {
		t.Error("a Q4_0 KV cache: no error")
	}
	// The batcher's pool is stored in the engine's KV dtype, which its
	// plan counted: the pool charges the budget the F16 bytes.
	e, err := Open(context.Background(), lm, Options{Backends: cpus(1), Context: ctxLen, Chunk: chunk, Memory: Memory{KVDType: tensor.F16}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	kv := e.budgets[0].UsedBy(paging.KVCache)
	b, err := e.NewBatcher(BatchOptions{})
	if err != nil {
		t.Fatalf("a batcher over an engine with an F16 KV cache: %v", err)
	}
	st := b.Stats()
	if got, want := e.budgets[0].UsedBy(paging.KVCache)-kv, int64(2*4*st.KVBlocks*st.BlockSize)*rowBytes[tensor.F16]; got != want {
		t.Errorf("the F16 pool of %d blocks of %d charged %d KV bytes, want %d", st.KVBlocks, st.BlockSize, got, want)
	}
	if err := b.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
}
