package tensor_test

import (
	"math/rand/v2"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestCPUEmbedRows: the CPU embeds a chunk of rows on its threads (one job
// on the pool) and a decode step's row on the calling goroutine (none),
// each row as embedding it alone gives it, in every float dtype.
func TestCPUEmbedRows(t *testing.T) {
	const vocab, d = 300, 1024
	r := rand.New(rand.NewPCG(5, 6))
	vals := make([]float32, vocab*d)
	for i := range vals {
		vals[i] = r.Float32()*2 - 1
	}
	c := tensor.NewCPU(4)
	defer c.Close()
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16} {
		for _, tc := range []struct {
			rows, jobs int
		}{
			{1, 0},   // a decode step
			{64, 1},  // 64 rows of 1024: a job
			{300, 1}, // more rows than tasks
		} {
			table := tensor.New(dt, tensor.Shape{vocab, d})
			switch dt {
			case tensor.F32:
				copy(table.F32(), vals)
			case tensor.F16:
				tensor.F32ToF16(table.U16(), vals)
			default:
				tensor.F32ToBF16(table.U16(), vals)
			}
			ids := make([]int32, tc.rows)
			for i := range ids {
				ids[i] = int32(r.IntN(vocab))
			}
			out := tensor.New(tensor.F32, tensor.Shape{tc.rows, d})
			j0 := tensor.ParallelJobs(c)
			if err := c.Embed(out, table, ids); err != nil {
				t.Fatal(err)
			}
			if jobs := tensor.ParallelJobs(c) - j0; jobs != int64(tc.jobs) {
				t.Errorf("%v, %d rows: %d jobs on the pool, want %d", dt, tc.rows, jobs, tc.jobs)
			}
			one := tensor.New(tensor.F32, tensor.Shape{1, d})
			for i, id := range ids {
				if err := c.Embed(one, table, []int32{id}); err != nil {
					t.Fatal(err)
				}
				bitsEqual(t, "row", out.F32()[i*d:(i+1)*d], one.F32())
			}
		}
	}
}
