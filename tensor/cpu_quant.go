package tensor

import (
	"fmt"
	"sync"

	"github.com/strata-llm/strata/tensor/quant"
)

// Blocking of the quantized CPU matrix product. Two threads decoding the
// 1.1B model's matrices on a shared 2-core AMD EPYC (AVX-512) reached
// about 0.35 of the read bandwidth in tasks of 32 KiB of weights, 0.5-0.75
// in tasks of 64 KiB, and 0.75-0.9 from 256 KiB up: each task's rows are a
// new stream for the prefetchers to find.
const (
	// qMinTask and qMaxTask bound the weights of a decode task.
	qMinTask = 256 << 10
	qMaxTask = 2 << 20
	// qPrefillTask bounds the weights of a prefill task: read from memory
	// for the first row of x, from the L2 cache for every other one.
	qPrefillTask = 128 << 10
	// qQuantizeElems is about the elements of x one task quantizes.
	qQuantizeElems = 32 << 10
)

// quantGemmRows is the number of rows of x from which MatMul multiplies
// quantized weights of dt on the packed gemm, dequantizing each task's
// weight rows to F32, rather than in integers (quant.GEMV once per row of
// x). On two threads of the same EPYC, 5632x2048 matrices: Q8_0 ran at 47
// GFLOP/s in integers and 50 on the gemm at 32 rows, 112 and 162 at 96;
// Q4_0 43 and 68 at 32; the K formats' integer products stay ahead or even
// up to about 100 rows (Q4_K 134 and 135 GFLOP/s at 96, 149 and 159 at
// 128, 146 and 176 at 512); and Q4_1 and Q5_0, whose integer products are
// Go alone, ran at 1 GFLOP/s against 2.5 to 3.5 on the gemm from 2 rows.
// Where quant runs its Go kernels for every format, the gemm wins from 2
// rows for all.
func quantGemmRows(dt DType) int {
	if quant.Kernels() == "go" {
		return 2
	}
	switch dt {
	case Q8_0, Q4_0:
		return 32
	case Q4_K, Q5_K, Q6_K:
		return 128
	}
	return 2
}

// qmatmul is one quantized MatMul call: the rows of x quantized for the
// weights' integer product (quant.QuantizeRow), and the weight rows split into tasks of per rows,
// each multiplied with every row of x. Recycled through qmatmulPool with
// its buffer, so that a call allocates nothing once the buffer is large
// enough.
type qmatmul struct {
	typ     quant.Type
	m, n, k int
	out     []float32
	w       []byte
	wb, xb  int    // bytes of a weight row, of a quantized row of x
	xq      []byte // the quantized rows of x, xb bytes each
	bias    fvec
	hasBias bool
	per     int // weight rows (rows of x while quantizing) per task

	x          []float32
	quantizing bool // the tasks quantize x
	mu         sync.Mutex
	err        error // the error of the first row of x that failed
	errRow     int

	buf *[]byte // xq's storage, kept across calls
}

var qmatmulPool = sync.Pool{New: func() any { return &qmatmul{buf: new([]byte)} }}

// release drops the operands and returns q to the pool.
func (q *qmatmul) release() {
	q.x, q.out, q.w, q.xq, q.bias, q.err, q.quantizing = nil, nil, nil, nil, fvec{}, nil, false
	qmatmulPool.Put(q)
}

// matMulQuant is MatMul with quantized weights, ggml's integer product
// (for fewer than quantGemmRows rows of x; see MatMul):
// each row of x is quantized once (quant.QuantizeRow: 16 bits per
// element, an F32 scale per block of the weights) and multiplied with the
// weight rows block by block in integer arithmetic (quant.GEMV). The
// result is the F32 product over the dequantized weights but for the
// rounding of the activations, about 0.004% (blocks of 32) to 0.005%
// (blocks of 256) of the product, twice that where a few large
// activations coarsen their block's step. Activations holding a NaN or
// an infinity are an error wrapping quant.ErrNotFinite.
func (c *CPU) matMulQuant(out, x, w, bias *Tensor) error {
	return c.matMulQuantRows(out, x, w, bias, false)
}

// matMulQuantRows is matMulQuant; when rows is set, every row of x is
// multiplied over the blocks of weight rows a one-row product uses, so that
// its bits are a one-row product's (MatMulRows).
func (c *CPU) matMulQuantRows(out, x, w, bias *Tensor, rows bool) error {
	q, tasks, err := c.quantTasks(out, x, w, bias, rows)
	if q == nil || err != nil {
		return err
	}
	defer q.release()
	c.runMaybe(q.m*q.n*q.k < minParallel, tasks, q)
	return nil
}

// quantTasks prepares matMulQuantRows' product: x quantized, and the
// product's tasks (q.run) left to run. It returns a nil q when there is
// nothing left to run; otherwise the caller runs the tasks and releases q.
func (c *CPU) quantTasks(out, x, w, bias *Tensor, rows bool) (*qmatmul, int, error) {
	typ, ok := w.dtype.Quant()
	if !ok || !quant.IntegerProduct(typ) {
		return nil, 0, fmt.Errorf("tensor: cpu: MatMul: %v weights have no integer product", w.dtype)
	}
	m, k, n := x.shape[0], x.shape[1], w.shape[0]
	if m == 0 || n == 0 {
		return nil, 0, nil
	}
	q := qmatmulPool.Get().(*qmatmul)
	done := false
	defer func() {
		if !done {
			q.release()
		}
	}()
	q.typ, q.m, q.n, q.k, q.out, q.w = typ, m, n, k, out.F32(), w.data
	xb := 0
	if k > 0 {
		var err error
		if xb, err = quant.ActivationBytes(typ, k); err != nil {
			return nil, 0, fmt.Errorf("tensor: cpu: MatMul: %w", err)
		}
	}
	q.wb, q.xb = k/typ.BlockSize()*typ.BlockBytes(), xb
	q.bias, q.hasBias = fvec{}, bias != nil
	if bias != nil {
		q.bias = newFvec(bias)
	}
	if k == 0 {
		for i := range m {
			for j := range n {
				q.out[i*n+j] = q.biasAt(j)
			}
		}
		return nil, 0, nil
	}
	need := m * q.xb
	if cap(*q.buf) < need {
		*q.buf = make([]byte, need)
	}
	q.xq = (*q.buf)[:need]
	q.x = x.F32()
	// Quantize x, rows spread over the pool when there are many.
	q.quantizing = true
	q.per = max(1, qQuantizeElems/k)
	c.runMaybe(m*k < 2*qQuantizeElems, (m+q.per-1)/q.per, q)
	if q.err != nil {
		return nil, 0, q.err
	}
	q.quantizing = false
	// Decode: about four tasks per thread, each of qMinTask to qMaxTask
	// bytes of weights. Prefill: tasks of qPrefillTask bytes.
	per := qPrefillTask / q.wb
	if m == 1 || rows {
		per = (n + 4*c.threads - 1) / (4 * c.threads)
		per = min(max(per, qMinTask/q.wb), qMaxTask/q.wb)
	}
	q.per = max(4, per)
	done = true
	return q, (n + q.per - 1) / q.per, nil
}

func (q *qmatmul) biasAt(j int) float32 {
	if !q.hasBias {
		return 0
	}
	return q.bias.at(j)
}

// run quantizes rows [t*per, ...) of x, or multiplies weight rows [t*per,
// ...) with every row of x.
func (q *qmatmul) run(t int) {
	if q.quantizing {
		q.quantize(t*q.per, min(q.m, (t+1)*q.per))
		return
	}
	j0 := t * q.per
	j1 := min(q.n, j0+q.per)
	w := q.w[j0*q.wb : j1*q.wb]
	for i := range q.m {
		o := q.out[i*q.n+j0 : i*q.n+j1]
		if err := quant.GEMV(q.typ, o, w, j1-j0, q.k, q.xq[i*q.xb:(i+1)*q.xb]); err != nil {
			panic(err) // unreachable: the operands were sized by matMulQuant
		}
		if q.hasBias {
			for c := range o {
				o[c] += q.bias.at(j0 + c)
			}
		}
	}
}

// quantize quantizes rows [i0, i1) of x, and keeps the first error.
func (q *qmatmul) quantize(i0, i1 int) {
	for i := i0; i < i1; i++ {
		err := quant.QuantizeRow(q.typ, q.xq[i*q.xb:(i+1)*q.xb], q.x[i*q.k:(i+1)*q.k])
		if err != nil {
			q.mu.Lock()
			if q.err == nil || i < q.errRow {
				q.err, q.errRow = fmt.Errorf("tensor: cpu: MatMul: row %d of x: %w", i, err), i
			}
			q.mu.Unlock()
			return
		}
	}
}

// embedQuant gathers rows of a quantized table, dequantized.
func embedQuant(out, table *Tensor, ids []int32) error {
	typ, ok := table.dtype.Quant()
	if !ok {
		return fmt.Errorf("tensor: cpu: Embed: no decoder for %v", table.dtype)
	}
	d := table.shape[1]
	rb := d / typ.BlockSize() * typ.BlockBytes()
	o := out.F32()
	for i, id := range ids {
		row := int(id)
		if err := typ.Dequantize(o[i*d:(i+1)*d], table.data[row*rb:(row+1)*rb]); err != nil {
			return fmt.Errorf("tensor: cpu: Embed: row %d: %w", row, err)
		}
	}
	return nil
}
