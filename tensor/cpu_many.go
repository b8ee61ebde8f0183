package tensor

import "sync"

// The CPU's fused products of one row of x (decode): MatMulMany (a block's
// q, k and v) and GateUpSiLU (gate and up) hand all their products' tasks
// to the pool as one job, so that the threads wait for each other once
// rather than once a product. Each task computes the rows it computes in
// MatMul, with the same kernels, so the results are MatMul's bits.

// manyTask runs the tasks of up to three products as one job: task i is
// task i-start[j] of part j. Recycled through manyPool with its parts, so
// that a call allocates nothing.
type manyTask struct {
	parts [3]task
	start [4]int
	n     int
}

var manyPool = sync.Pool{New: func() any { return new(manyTask) }}

func (t *manyTask) add(p task, tasks int) {
	t.parts[t.n] = p
	t.start[t.n+1] = t.start[t.n] + tasks
	t.n++
}

func (t *manyTask) run(i int) {
	j := 0
	for i >= t.start[j+1] {
		j++
	}
	t.parts[j].run(i - t.start[j])
}

// release gives the parts' state back to their pools, then t to manyPool.
func (t *manyTask) release() {
	for _, p := range t.parts[:t.n] {
		switch p := p.(type) {
		case *matmul:
			p.release()
		case *qmatmul:
			p.release()
		}
	}
	*t = manyTask{}
	manyPool.Put(t)
}

// MatMulMany computes outs[i] = x·ws[i]ᵀ (tensor.MatMulMany): for one row
// of x and up to three weights, one job over all their rows; otherwise a
// MatMul each.
func (c *CPU) MatMulMany(outs []*Tensor, x *Tensor, ws []*Tensor) error {
	for i := range outs {
		if err := operands("MatMulMany", outs[i], x, ws[i], nil); err != nil {
			return err
		}
	}
	if x.shape[0] != 1 || len(ws) > len(manyTask{}.parts) {
		for i := range outs {
			if err := c.MatMul(outs[i], x, ws[i], nil); err != nil {
				return err
			}
		}
		return nil
	}
	many := manyPool.Get().(*manyTask)
	defer many.release()
	work := 0
	for i, w := range ws {
		t, tasks, err := c.decodeTasks(outs[i], x, w)
		if err != nil {
			return err
		}
		if t != nil {
			many.add(t, tasks)
			work += w.shape[0] * w.shape[1]
		}
	}
	c.runMaybe(work < minParallel, many.start[many.n], many)
	return nil
}

// GateUpSiLU computes out = silu(x·wGateᵀ) * (x·wUpᵀ) (tensor.GateUpSiLU):
// both products as MatMulMany, then SiLUMul; up holds x·wUpᵀ after.
func (c *CPU) GateUpSiLU(out, up, x, wGate, wUp *Tensor) error {
	if err := c.MatMulMany([]*Tensor{out, up}, x, []*Tensor{wGate, wUp}); err != nil {
		return err
	}
	return c.SiLUMul(out, out, up)
}

// decodeTasks prepares the product out = x·wᵀ of one row of x as MatMul
// runs it, without running it: the task and its number of tasks, or a nil
// task when nothing is left to run. The caller runs the tasks and gives
// the task's state back (manyTask.release).
func (c *CPU) decodeTasks(out, x, w *Tensor) (task, int, error) {
	if w.dtype.IsQuantized() {
		q, tasks, err := c.quantTasks(out, x, w, nil, false)
		if q == nil || err != nil {
			return nil, 0, err
		}
		return q, tasks, nil
	}
	k, n := x.shape[1], w.shape[0]
	if n == 0 {
		return nil, 0, nil
	}
	mm := matmulPool.Get().(*matmul)
	*mm = matmul{k: c.k, m: 1, n: n, kd: k, x: x.F32(), out: out.F32(), wdt: w.dtype, scratch: mm.scratch}
	if w.dtype == F32 {
		mm.w32 = w.F32()
	} else {
		mm.w16 = w.U16()
	}
	if k == 0 {
		mm.zeroK()
		mm.release()
		return nil, 0, nil
	}
	mm.per = decodePer(n, k)
	mm.mode = modeDecode
	return mm, (n + mm.per - 1) / mm.per, nil
}
