package nn

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// A sparse block's MLP runs in these steps, with the backend's existing
// kernels and the routing on the host:
//
//  1. The router's scores [T, experts] (and the shared expert's gate
//     [T, 1]) are computed on the device and downloaded: a few floats per
//     token.
//  2. On the host, as transformers does in float32: a softmax over all the
//     experts, the k best (the lower index first among equals), their
//     weights renormalised to sum to 1 when NormTopK; the shared expert's
//     weight is the sigmoid of its gate. The chosen (token, expert) pairs
//     are grouped by expert, in expert order, each group's tokens in order;
//     pair p of the grouping is row p of out. The weights of out's rows and
//     the shared expert's weights are uploaded in one table.
//  3. Each expert chosen by some token runs once on its tokens' rows of h
//     (gathered with Embed, or h itself when every token chose it, as in a
//     decode step): so a chunk reads each expert's weights once. Its output
//     rows land in out.
//  4. out's rows are multiplied by their weights, and each token's rows
//     are gathered back and summed into proj, then the shared expert's
//     output, weighted, is added.
//
// The weighting is Rope with a head size of 2 and a zero sine table: it
// turns each pair of columns (a, b) of row r into (a·w_r, b·w_r), exactly,
// where w_r is row r of the cosine table (arch requires an even hidden size
// for a mixture of experts).

// moeBuffers are a device's buffers for the mixtures of experts, and the
// host's routing scratch.
type moeBuffers struct {
	scores *tensor.Tensor // [chunk, Experts] the router's
	gateSh *tensor.Tensor // [chunk, 1] the shared expert's gate, or nil
	rows   *tensor.Tensor // [chunk, Hidden]: an expert's tokens' rows; one slot of out, gathered back; the shared expert's output
	out    *tensor.Tensor // [chunk*k, Hidden] the chosen experts' outputs, grouped by expert
	// weight holds the weight of each row of out, then the shared expert's
	// weight of each token ([chunk*(k+1), 1]); zero is the zero sine table
	// of the same shape.
	weight, zero *tensor.Tensor
	views        map[moeView]*tensor.Tensor // views of the buffers, made once
	r            routing
}

// moeView names a view of one of moeBuffers' tensors: n rows of width w
// from row off.
type moeView struct {
	t         *tensor.Tensor
	off, n, w int
}

// moeReserve is what newMoEBuffers allocates for each token of a chunk,
// F32: the router's scores, the gathered rows and k expert outputs of
// Hidden, the two weight tables of k+1 rows, and the shared expert's gate.
func moeReserve(c *arch.Config) paging.Reserve {
	m := c.MoE
	if m == nil {
		return nil
	}
	row := func(n int) int64 { return 4 * int64(n) }
	r := paging.Reserve{
		{Category: paging.Activations, Bytes: row(m.Experts), Per: paging.PerToken, Count: 1},
		{Category: paging.Activations, Bytes: row(c.HiddenSize), Per: paging.PerToken, Count: 1 + m.ExpertsPerToken},
		{Category: paging.Activations, Bytes: row(m.ExpertsPerToken + 1), Per: paging.PerToken, Count: 2},
	}
	if m.SharedExperts > 0 {
		r = append(r, paging.Buffer{Category: paging.Activations, Bytes: row(1), Per: paging.PerToken, Count: 1})
	}
	return r
}

func newMoEBuffers(c *arch.Config, al *allocator, chunk int) *moeBuffers {
	m := c.MoE
	k := m.ExpertsPerToken
	mb := &moeBuffers{views: map[moeView]*tensor.Tensor{}}
	mb.scores = al.alloc(paging.Activations, chunk, m.Experts)
	if m.SharedExperts > 0 {
		mb.gateSh = al.alloc(paging.Activations, chunk, 1)
	}
	mb.rows = al.alloc(paging.Activations, chunk, c.HiddenSize)
	mb.out = al.alloc(paging.Activations, chunk*k, c.HiddenSize)
	mb.weight = al.alloc(paging.Activations, chunk*(k+1), 1)
	mb.zero = al.alloc(paging.Activations, chunk*(k+1), 1)
	mb.r = routing{
		raw:     make([]byte, 4*chunk*m.Experts),
		rawSh:   make([]byte, 4*chunk),
		expert:  make([]int32, chunk*k),
		weight:  make([]float32, chunk*k),
		count:   make([]int, m.Experts),
		start:   make([]int, m.Experts),
		tokens:  make([]int32, chunk*k),
		table:   make([]float32, chunk*(k+1)),
		slots:   make([][]int32, k),
		combine: make([]int32, chunk*k),
		fill:    make([]int, m.Experts),
		used:    make([]int, 0, m.Experts),

		rawGuess: make([]byte, 4*m.Experts),
		devUsed:  make([]int, 0, m.Experts),
		cpuUsed:  make([]int, 0, m.Experts),
	}
	for j := range mb.r.slots {
		mb.r.slots[j] = make([]int32, chunk)
	}
	return mb
}

// clearZero fills the zero table.
func (mb *moeBuffers) clearZero(b tensor.Backend) error {
	return uploadF32(b, mb.zero, make([]float32, mb.zero.Len()))
}

// view returns n rows of width w of t from row off (of width w).
func (mb *moeBuffers) view(t *tensor.Tensor, off, n, w int) *tensor.Tensor {
	key := moeView{t, off, n, w}
	if v, ok := mb.views[key]; ok {
		return v
	}
	v, err := t.View(4*int64(off)*int64(w), tensor.F32, tensor.Shape{n, w})
	if err != nil {
		panic(err) // the buffers are sized for a chunk's rows
	}
	if len(mb.views) >= 1<<12 {
		clear(mb.views) // prefill makes views of many sizes; decode reuses a few
	}
	mb.views[key] = v
	return v
}

// routing is the host's side of a sparse block: the routing of a chunk's
// tokens and its grouping by expert.
type routing struct {
	raw, rawSh []byte    // the router's scores and the shared gate, downloaded
	expert     []int32   // [T*k] each token's chosen experts, best first
	weight     []float32 // [T*k] their weights
	count      []int     // [experts] the tokens that chose each expert
	start      []int     // [experts] the first row of out of each expert
	tokens     []int32   // [T*k] the token of each row of out
	table      []float32 // [T*k+T] the weight of each row of out, then each token's shared weight
	slots      [][]int32 // [k][T] the row of out holding token t's j-th expert's output
	combine    []int32   // [T*k] slots as CombineRows takes them: token t's j-th at t*k+j
	fill       []int     // [experts] scratch: each expert's rows filled so far (cpuLast)
	used       []int     // the experts some token chose, ascending
	rawGuess   []byte    // the next sparse block's router scores of a decode step
	rowPos     []int     // in a batch, each row's position (else row t is at pos0+t)
	// The experts the CPU computes (expertOnCPU): the chosen ones split
	// (devUsed, cpuUsed) by the weights' choice (onCPU, from each one's
	// tokens, usedTokens), the chunk's rows of h downloaded (hostH), the
	// scratch of each expert computed at once (cpuScratch), and the
	// outputs of them all (hostO, rows as out's).
	devUsed, cpuUsed []int
	usedTokens       []int
	onCPU            []bool
	hostH            []byte
	cpuScratch       []cpuScratch
	hostO            []float32
	// h and o are the rows the CPU's experts read and write in this
	// chunk: hostH's and hostO's, or for a decode step's one token the
	// session's page-locked step rows (Session.stepBuf).
	h, o []float32
}

// cpuExpertsAtOnce is the most experts a sparse block computes on the CPU
// at once, each product spread over the CPU's threads with the others':
// one expert's products (9.4 MB for the Qwen3-30B-A3B shape) read host
// memory at 37.9 GB/s on the H200's host over 16 threads, where the host
// reads 97.7, the fork and join of each product a fixed cost that several
// at once share.
const cpuExpertsAtOnce = 4

// cpuScratch is what one expert computed on the CPU needs: its tokens'
// rows (x), its gate and up.
type cpuScratch struct{ x, g, u []float32 }

// route picks each of T tokens' k experts from the router's scores [T, E]
// and groups the choices by expert into r's tables, as transformers does in
// float32: a softmax over all the experts, the k largest probabilities (the
// lower index first among equals) and, when norm, those divided by their
// sum. With syn, syn draws the experts of block for the tokens at positions
// pos0.. (r.rowPos's in a batch, whose rows are several sequences'), and
// the softmax weighs them.
func (r *routing) route(scores []float32, T, E, k int, norm bool, syn *synthRouter, block, pos0 int) {
	clear(r.count[:E])
	for t := range T {
		row := scores[t*E : (t+1)*E]
		mx := float32(math.Inf(-1))
		for _, v := range row {
			mx = max(mx, v)
		}
		var sum float32
		for _, v := range row {
			sum += float32(math.Exp(float64(v - mx)))
		}
		ex, w := r.expert[t*k:(t+1)*k], r.weight[t*k:(t+1)*k]
		if syn != nil {
			pos := pos0 + t
			if r.rowPos != nil {
				pos = r.rowPos[t]
			}
			syn.pick(block, pos, ex)
		}
		if syn == nil {
			topK(row, ex)
		}
		for j := range k {
			w[j] = float32(math.Exp(float64(row[ex[j]]-mx))) / sum
		}
		if norm {
			var s float32
			for _, v := range w {
				s += v
			}
			for j := range w {
				w[j] /= s
			}
		}
		for _, e := range ex {
			r.count[e]++
		}
	}
	next := 0
	for e := range E {
		r.start[e] = next
		next += r.count[e]
	}
	fill := r.count[:E] // reused as each expert's rows filled so far
	clear(fill)
	r.placeRows(T, k, fill) // fill holds each expert's count again after
}

// placeRows gives each of T tokens' k choices its row of out, expert e's
// rows from r.start[e] on in the order of the tokens, counting them in
// fill (zero on entry), with its token, weight and slot.
func (r *routing) placeRows(T, k int, fill []int) {
	for t := range T {
		for j, e := range r.expert[t*k : (t+1)*k] {
			row := r.start[e] + fill[e]
			fill[e]++
			r.tokens[row] = int32(t)
			r.table[row] = r.weight[t*k+j]
			r.slots[j][t] = int32(row)
		}
	}
}

// cpuLast lays the rows of out anew after route, the experts of dev
// first and those of onCPU after them (each expert's rows together, its
// tokens in order, as route has them), so that the CPU's outputs go up to
// the device in one copy; it returns the first row of the CPU's. The
// weights and slots follow the rows, so the block's result has the same
// bits.
func (r *routing) cpuLast(T, k int, dev, onCPU []int) int {
	next := 0
	for _, e := range dev {
		r.start[e], r.fill[e] = next, 0
		next += r.count[e]
	}
	cpuRow := next
	for _, e := range onCPU {
		r.start[e], r.fill[e] = next, 0
		next += r.count[e]
	}
	r.placeRows(T, k, r.fill)
	return cpuRow
}

// topK fills ex with the indices of the len(ex) largest scores, best
// first, the lower index first among equals.
func topK(row []float32, ex []int32) {
	for j := range ex {
		best := int32(-1)
		for e, v := range row {
			if best >= 0 && v <= row[best] || taken(ex[:j], int32(e)) {
				continue
			}
			best = int32(e)
		}
		ex[j] = best
	}
}

// taken reports whether e is in chosen.
func taken(chosen []int32, e int32) bool {
	for _, c := range chosen {
		if c == e {
			return true
		}
	}
	return false
}

// f32s views b, a multiple of 4 bytes, as float32s.
func f32s(b []byte) []float32 { return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4) }

// moe runs the mixture of experts of sparse block i on the first T rows of
// h (the MLP norm's output), leaving its output in the first T rows of
// proj. When the model's Weights page the block's experts (ExpertWeights)
// it acquires the chosen ones, at most ExpertSlots at a time, and in a
// decode step guesses the next sparse block's experts and prefetches
// them (guessNext).
func (s *Session) moe(ctx context.Context, i, T, pos0 int, lw LayerWeights) error {
	m, b, c := s.m, s.m.backend, &s.m.cfg
	layer := m.blockLayer(i)
	n, experts := &m.names[layer], m.experts[layer]
	mc, mb, v := c.MoE, s.buffers.moe, s.viewsFor(T)
	E, k, H := mc.Experts, mc.ExpertsPerToken, c.HiddenSize
	h, proj := v.h, v.proj
	r := &mb.r

	scores := mb.view(mb.scores, 0, T, E)
	if err := s.matMul(scores, h, lw[n[arch.Router]], nil); err != nil {
		return fmt.Errorf("router: %w", err)
	}
	t0 := time.Now()
	var t1 time.Time
	defer func() { m.sparse.add(t0, t1) }()
	var gateSh *tensor.Tensor
	if mc.SharedExperts > 0 {
		gateSh = mb.view(mb.gateSh, 0, T, 1)
		if err := s.matMul(gateSh, h, lw[n[arch.SharedScale]], nil); err != nil {
			return fmt.Errorf("shared expert gate: %w", err)
		}
	}
	ew := m.pagedExperts(layer)
	if pr, ok := ew.(expertPreparer); ok && T == 1 {
		// While the device computes the router, the acquire's choice of
		// slots, off the time from the scores to the first copy.
		pr.PrepareExperts(layer, 2*k)
	}
	raw := s.stepScores(4 * T * E)
	if err := tensor.DownloadComputed(b, raw, scores); err != nil {
		return fmt.Errorf("router: %w", err)
	}
	t1 = time.Now()
	r.rowPos = nil
	if s.batch != nil {
		r.rowPos = s.batch.rowPos
	}
	r.route(f32s(raw), T, E, k, mc.NormTopK, m.synth, i, pos0)
	tensor.Mark(b, "routed") // on a timeline (tensor.Marker): the host's steps from the scores to the first copy
	switch {
	case ew != nil && s.batch == nil:
		s.scoreGuess(i, T, pos0, r.expert[(T-1)*k:T*k])
	case ew != nil:
		s.scoreBatchGuess(i)
	}
	r.used = r.used[:0]
	for e := range E {
		if r.count[e] > 0 {
			r.used = append(r.used, e)
		}
	}
	var dev, onCPU []int
	cpuRow := T * k // the first row of out the CPU's experts fill
	if ew != nil {
		if dev, onCPU = s.splitExperts(ew, layer); len(onCPU) > 0 {
			cpuRow = r.cpuLast(T, k, dev, onCPU)
		}
		tensor.Mark(b, "split")
	}
	// The misses' copies are queued first, before anything else the host
	// does with the routing: the link idles from the last copy of one
	// sparse block to the first of the next, and every host step in
	// between adds to that gap.
	var slots int
	var first expertGroup
	if ew != nil {
		slots = max(ew.ExpertSlots(), 1)
		if len(dev) > 0 {
			var err error
			if first, err = acquireGroup(ctx, ew, layer, dev[:min(slots, len(dev))]); err != nil {
				return err
			}
			tensor.Mark(b, "acquired")
			defer first.release() // released even if the backend panics
		}
	}
	if gateSh != nil {
		if err := tensor.DownloadComputed(b, r.rawSh[:4*T], gateSh); err != nil {
			return fmt.Errorf("shared expert gate: %w", err)
		}
		for t, g := range f32s(r.rawSh[:4*T]) {
			r.table[T*k+t] = float32(1 / (1 + math.Exp(-float64(g))))
		}
	}
	nw := T * k
	if gateSh != nil {
		nw += T
	}
	if err := b.Upload(mb.weight, 0, unsafe.Slice((*byte)(unsafe.Pointer(&r.table[0])), 4*nw)); err != nil {
		return fmt.Errorf("routing weights: %w", err)
	}
	if ew == nil {
		for _, e := range r.used {
			if err := s.expert(e, T, lw, &experts[e]); err != nil {
				return err
			}
		}
	} else {
		// The order lets the link, the device and the CPU work at once:
		// the first group's copies are queued; what the host waits for
		// (the rows the CPU computes with, the next block's router for
		// the guess) is downloaded while the compute stream holds nothing
		// that waits for a copy; the CPU starts its experts; then the
		// device's experts are queued behind their copies; then the
		// guess's prefetches, behind this block's misses on the link;
		// then the CPU's experts' outputs go up, last.
		//
		// The CPU's experts start as soon as their rows are down, on
		// goroutines of their own, and run while the host queues the
		// device's experts (a few launches each) and the link copies:
		// computed after that queueing, they ran mostly after the copies.
		// A panic of theirs is raised again here (cpuPanic).
		var cpuDone chan error
		if len(onCPU) > 0 {
			hb, ob := r.hostH[:4*T*H], r.hostO
			if T == 1 && s.batch == nil {
				hb, ob = s.stepRows()
			}
			if err := tensor.DownloadComputed(b, hb, h); err != nil {
				return fmt.Errorf("experts on the CPU: %w", err)
			}
			r.h, r.o = f32s(hb), ob
			cpuDone = make(chan error, 1)
			cw := ew.(CPUExpertWeights)
			go func() { cpuDone <- s.expertsOnCPU(ctx, cw, layer, onCPU, experts) }()
			defer func() {
				if cpuDone != nil { // an early return: the CPU's experts still use the session's rows
					<-cpuDone
				}
			}()
		}
		var next expertGuess
		if T == 1 && s.batch == nil || s.batchDecode(T) {
			var err error
			if next, err = s.guessNext(ctx, ew, i, pos0); err != nil {
				return err
			}
			if next.experts != nil && !m.guessRecord.worthPrefetching(next.block) {
				next.experts = nil // guessed and scored, not prefetched
			}
		}
		for g := 0; g < len(dev); g += slots {
			group := dev[g:min(g+slots, len(dev))]
			a := first
			if g > 0 {
				var err error
				if a, err = acquireGroup(ctx, ew, layer, group); err != nil {
					return err
				}
			}
			err := func() error {
				defer a.release() // released even if the backend panics
				// The cached experts first, while the misses' copies
				// land; then each miss behind its own copies, in the
				// order they land.
				for _, e := range group {
					if slices.Contains(a.pending, e) {
						continue
					}
					if err := s.expert(e, T, a.ws[e], &experts[e]); err != nil {
						return err
					}
				}
				for _, e := range a.pending {
					if err := a.await(e); err != nil {
						return fmt.Errorf("experts: %w", err)
					}
					if err := s.expert(e, T, a.ws[e], &experts[e]); err != nil {
						return err
					}
				}
				if g+slots >= len(dev) && next.experts != nil {
					// While the last group is pinned: the prefetch
					// does not evict the experts computing.
					ew.PrefetchExperts(next.layer, next.experts)
					next.experts = nil
				}
				return nil
			}()
			if err != nil {
				return err
			}
		}
		if next.experts != nil {
			ew.PrefetchExperts(next.layer, next.experts)
		}
		if cpuDone != nil {
			err := <-cpuDone
			cpuDone = nil
			if p, ok := err.(cpuPanic); ok {
				panic(p.v)
			}
			if err != nil {
				return err
			}
		}
		if n := T*k - cpuRow; n > 0 { // the CPU's experts' rows, last in out (cpuLast)
			if err := b.Upload(mb.view(mb.out, cpuRow, n, H), 0, unsafe.Slice((*byte)(unsafe.Pointer(&r.o[cpuRow*H])), 4*n*H)); err != nil {
				return fmt.Errorf("experts' outputs from the CPU: %w", err)
			}
		}
	}
	if err := s.combineExperts(T, proj); err != nil {
		return err
	}
	if gateSh == nil {
		return nil
	}

	sn := mc.SharedSize
	gate, up, out := mb.view(s.gate, 0, T, sn), mb.view(s.up, 0, T, sn), mb.view(mb.rows, 0, T, H)
	if err := s.matMul(gate, h, lw[n[arch.SharedGate]], nil); err != nil {
		return fmt.Errorf("shared expert gate projection: %w", err)
	}
	if err := s.matMul(up, h, lw[n[arch.SharedUp]], nil); err != nil {
		return fmt.Errorf("shared expert up projection: %w", err)
	}
	if err := b.SiLUMul(gate, gate, up); err != nil {
		return err
	}
	if err := s.matMul(out, gate, lw[n[arch.SharedDown]], nil); err != nil {
		return fmt.Errorf("shared expert down projection: %w", err)
	}
	if err := scaleRows(b, out, mb.weight, mb.zero, T*k); err != nil {
		return fmt.Errorf("shared expert weights: %w", err)
	}
	return b.Add(proj, proj, out)
}

// cpuPanic carries a panic of a sparse block's experts on the CPU, which
// run on a goroutine of their own, to the block's, which raises it again.
type cpuPanic struct{ v any }

func (p cpuPanic) Error() string { return fmt.Sprintf("experts on the CPU: panic: %v", p.v) }

// expertPreparer is an ExpertWeights that can work out an acquire's
// slots ahead of it (paging.Pager.PrepareExperts).
type expertPreparer interface{ PrepareExperts(layer, n int) }

// stepScores returns n bytes for a sparse block's router scores: for a
// decode step's, the session's step buffer (stepBuf), which the device
// copies into directly where it is page-locked, where a copy to pageable
// memory is staged through the driver's buffer (a copy of 512 bytes took
// 17 us on the H200, every sparse block, while the link waited for the
// misses it decides); a chunk's scores go to the chunk's pageable buffer.
func (s *Session) stepScores(n int) []byte {
	E := s.m.cfg.MoE.Experts
	if n > 4*E {
		return s.buffers.moe.r.raw[:n]
	}
	return s.stepBuf()[:n]
}

// stepRows returns the rows a decode step's experts on the CPU read (h, as
// bytes) and write (o, each of the k chosen experts' output), in the
// session's step buffer (stepBuf) after the scores.
func (s *Session) stepRows() (h []byte, o []float32) {
	c := &s.m.cfg
	E, H, k := c.MoE.Experts, c.HiddenSize, c.MoE.ExpertsPerToken
	buf := s.stepBuf()
	return buf[4*E : 4*E+4*H], f32s(buf[4*E+4*H : 4*E+4*H+4*k*H])
}

// stepBuf is the session's buffer for a decode step's sparse blocks: the
// router's scores, then the row of h and the k output rows of the
// experts the CPU computes. It is page-locked memory of the backend's
// where it has some (tensor.Pinned), which the device copies into and
// out of directly, else ordinary memory.
func (s *Session) stepBuf() []byte {
	if s.stepRaw == nil {
		c := &s.m.cfg
		n := 4 * (c.MoE.Experts + c.HiddenSize + c.MoE.ExpertsPerToken*c.HiddenSize)
		s.stepRaw = make([]byte, n)
		if pa, ok := tensor.Pinned(s.m.backend); ok {
			if buf, err := pa.AllocPinned(int64(n)); err == nil {
				s.stepRaw, s.stepPinned = buf, true
			}
		}
	}
	return s.stepRaw
}

// freeStepBuf gives back stepBuf's page-locked memory.
func (s *Session) freeStepBuf() {
	if s.stepPinned {
		if pa, ok := tensor.Pinned(s.m.backend); ok {
			_ = pa.FreePinned(s.stepRaw) // the backend's own memory: its error is a bug of its accounting
		}
	}
	s.stepRaw, s.stepPinned = nil, false
}

// expertGroup is a group of a block's experts acquired lazily
// (AcquireExpertsLazy): their weights, the misses whose copies are in
// flight, the wait for one, and the release, which runs once.
type expertGroup struct {
	ws      map[int]LayerWeights
	pending []int
	await   func(e int) error
	release func()
}

func acquireGroup(ctx context.Context, ew ExpertWeights, layer int, group []int) (expertGroup, error) {
	ws, pending, await, err := ew.AcquireExpertsLazy(ctx, layer, group)
	if err != nil {
		return expertGroup{}, fmt.Errorf("experts: %w", err)
	}
	var once sync.Once
	return expertGroup{ws, pending, await, func() { once.Do(func() { ew.ReleaseExperts(layer, group) }) }}, nil
}

// combineExperts sums each of the chunk's T tokens' expert outputs (their
// rows of out) weighted by their routing weights into proj: in one pass
// where the backend combines rows (tensor.CombineRows), else by scaling
// out's rows, then gathering and adding them an expert slot at a time.
// Both add in the order of the slots with each product rounded, so their
// results have the same bits.
func (s *Session) combineExperts(T int, proj *tensor.Tensor) error {
	b, mb, H, k := s.m.backend, s.buffers.moe, s.m.cfg.HiddenSize, s.m.cfg.MoE.ExpertsPerToken
	r := &mb.r
	out, w := mb.view(mb.out, 0, T*k, H), mb.view(mb.weight, 0, T*k, 1)
	if tensor.CanCombineRows(b) {
		for t := range T {
			for j := range k {
				r.combine[t*k+j] = r.slots[j][t]
			}
		}
		if err := tensor.CombineRows(b, proj, out, w, r.combine[:T*k], k); err != nil {
			return fmt.Errorf("experts' outputs: %w", err)
		}
		return nil
	}
	if err := scaleRows(b, out, mb.weight, mb.zero, 0); err != nil {
		return fmt.Errorf("routing weights: %w", err)
	}
	for j := range k {
		dst := proj
		if j > 0 {
			dst = mb.view(mb.rows, 0, T, H)
		}
		if err := b.Embed(dst, out, r.slots[j][:T]); err != nil {
			return fmt.Errorf("experts' outputs: %w", err)
		}
		if j > 0 {
			if err := b.Add(proj, proj, dst); err != nil {
				return err
			}
		}
	}
	return nil
}

// expert runs expert e on its tokens' rows of h (the first T rows),
// its weights in lw under the names en, leaving its output in its rows of
// out.
func (s *Session) expert(e, T int, lw LayerWeights, en *arch.Names) error {
	b, c, mb := s.m.backend, &s.m.cfg, s.buffers.moe
	r, H, size := &mb.r, c.HiddenSize, c.MoE.ExpertSize
	h := s.viewsFor(T).h
	cnt := r.count[e]
	in := h
	if cnt < T { // else every token chose e: its rows are h's, in order
		in = mb.view(mb.rows, 0, cnt, H)
		if err := b.Embed(in, h, r.tokens[r.start[e]:r.start[e]+cnt]); err != nil {
			return fmt.Errorf("expert %d: tokens: %w", e, err)
		}
	}
	gate, up := mb.view(s.gate, 0, cnt, size), mb.view(s.up, 0, cnt, size)
	if s.batch == nil {
		// Both products in one pass (one launch) where the backend
		// fuses them, as a dense MLP's.
		if err := tensor.GateUpSiLU(b, gate, up, in, lw[en[arch.ExpertGate]], lw[en[arch.ExpertUp]]); err != nil {
			return fmt.Errorf("expert %d gate and up projections: %w", e, err)
		}
	} else {
		if err := s.matMul(gate, in, lw[en[arch.ExpertGate]], nil); err != nil {
			return fmt.Errorf("expert %d gate projection: %w", e, err)
		}
		if err := s.matMul(up, in, lw[en[arch.ExpertUp]], nil); err != nil {
			return fmt.Errorf("expert %d up projection: %w", e, err)
		}
		if err := b.SiLUMul(gate, gate, up); err != nil {
			return err
		}
	}
	if err := s.matMul(mb.view(mb.out, r.start[e], cnt, H), gate, lw[en[arch.ExpertDown]], nil); err != nil {
		return fmt.Errorf("expert %d down projection: %w", e, err)
	}
	return nil
}

// splitExperts splits the experts the chunk chose (r.used) into those the
// device computes and those the weights hand to the CPU (CPUExpertWeights,
// with the model's CPU set: SetExpertCPU), which choose among the layer's
// misses together.
func (s *Session) splitExperts(ew ExpertWeights, layer int) (dev, onCPU []int) {
	r := &s.buffers.moe.r
	cw, ok := ew.(CPUExpertWeights)
	if !ok || s.m.expertCPU == nil {
		return r.used, nil
	}
	dev, onCPU = r.devUsed[:0], r.cpuUsed[:0]
	r.usedTokens = r.usedTokens[:0]
	for _, e := range r.used {
		r.usedTokens = append(r.usedTokens, r.count[e])
	}
	r.onCPU = slices.Grow(r.onCPU[:0], len(r.used))[:len(r.used)]
	cw.ExpertsOnCPU(layer, r.used, r.usedTokens, r.onCPU)
	for i, e := range r.used {
		if r.onCPU[i] {
			onCPU = append(onCPU, e)
		} else {
			dev = append(dev, e)
		}
	}
	if len(onCPU) > 0 && r.hostH == nil { // made when first needed: a chunk's rows, several times
		c := &s.m.cfg
		chunk, H, size := s.buffers.moe.rows.Shape()[0], c.HiddenSize, c.MoE.ExpertSize
		r.hostH = make([]byte, 4*chunk*H)
		r.hostO = make([]float32, chunk*c.MoE.ExpertsPerToken*H)
		r.cpuScratch = make([]cpuScratch, cpuExpertsAtOnce)
		for i := range r.cpuScratch {
			r.cpuScratch[i] = cpuScratch{make([]float32, chunk*H), make([]float32, chunk*size), make([]float32, chunk*size)}
		}
	}
	return dev, onCPU
}

// expertsOnCPU runs the experts onCPU of layer on the model's CPU
// (expertOnCPU), up to cpuExpertsAtOnce at once: worker w computes the
// experts w, w+n, ... of onCPU with scratch w, so that which expert each
// computes does not depend on timing. The first error in onCPU's order is
// returned, once every worker has stopped; a worker's panic comes back as
// a cpuPanic, for the block to raise again on its own goroutine.
func (s *Session) expertsOnCPU(ctx context.Context, cw CPUExpertWeights, layer int, onCPU []int, experts []arch.Names) error {
	r := &s.buffers.moe.r
	n := min(len(onCPU), len(r.cpuScratch))
	errs := make([]error, len(onCPU))
	panics := make([]any, n)
	work := func(w int) {
		defer func() { panics[w] = recover() }()
		for i := w; i < len(onCPU); i += n {
			e := onCPU[i]
			if errs[i] = s.expertOnCPU(ctx, cw, layer, e, &experts[e], &r.cpuScratch[w]); errs[i] != nil {
				return
			}
		}
	}
	var wg sync.WaitGroup
	for w := 1; w < n; w++ {
		wg.Go(func() { work(w) })
	}
	if n > 0 {
		work(0)
	}
	wg.Wait()
	for _, p := range panics {
		if p != nil {
			return cpuPanic{p}
		}
	}
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// expertOnCPU runs expert e of layer on the model's CPU, from its weights
// in host memory (cw.HostExpert), on its tokens' rows of r.h (the first T
// rows of h, downloaded), with the scratch sc, leaving its output in its
// rows of r.o (laid out as out, for the caller to upload): the
// same products as expert, in the same order.
func (s *Session) expertOnCPU(ctx context.Context, cw CPUExpertWeights, layer, e int, en *arch.Names, sc *cpuScratch) error {
	m, c, mb := s.m, &s.m.cfg, s.buffers.moe
	r, H, size := &mb.r, c.HiddenSize, c.MoE.ExpertSize
	cpu := m.expertCPU
	cnt := r.count[e]
	ws, release, err := cw.HostExpert(ctx, layer, e, cnt)
	if err != nil {
		return fmt.Errorf("expert %d on the CPU: %w", e, err)
	}
	defer release()
	hh := r.h
	for j, t := range r.tokens[r.start[e] : r.start[e]+cnt] {
		copy(sc.x[j*H:(j+1)*H], hh[int(t)*H:(int(t)+1)*H])
	}
	x, err1 := tensor.FromF32(tensor.Shape{cnt, H}, sc.x[:cnt*H])
	gate, err2 := tensor.FromF32(tensor.Shape{cnt, size}, sc.g[:cnt*size])
	up, err3 := tensor.FromF32(tensor.Shape{cnt, size}, sc.u[:cnt*size])
	start := r.start[e]
	out, err4 := tensor.FromF32(tensor.Shape{cnt, H}, r.o[start*H:(start+cnt)*H])
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return fmt.Errorf("expert %d on the CPU: %w", e, err)
	}
	mm := cpu.MatMul
	if s.batch != nil {
		mm = func(out, x, w, bias *tensor.Tensor) error { return tensor.MatMulRows(cpu, out, x, w, bias) }
	}
	if err := mm(gate, x, ws[en[arch.ExpertGate]], nil); err != nil {
		return fmt.Errorf("expert %d gate projection on the CPU: %w", e, err)
	}
	if err := mm(up, x, ws[en[arch.ExpertUp]], nil); err != nil {
		return fmt.Errorf("expert %d up projection on the CPU: %w", e, err)
	}
	if err := cpu.SiLUMul(gate, gate, up); err != nil {
		return fmt.Errorf("expert %d on the CPU: %w", e, err)
	}
	if err := mm(out, gate, ws[en[arch.ExpertDown]], nil); err != nil {
		return fmt.Errorf("expert %d down projection on the CPU: %w", e, err)
	}
	return nil
}

// SetExpertCPU gives the model a CPU to compute the experts its weights
// hand over (CPUExpertWeights) on; nil computes every expert on the
// model's backend. Call it before sessions run.
func (m *Model) SetExpertCPU(cpu tensor.Backend) {
	if cpu != nil {
		cpu = tensor.Checked(cpu)
	}
	m.expertCPU = cpu
}

// pagedExperts returns the model's Weights as ExpertWeights when they page
// layer's experts, else nil.
func (m *Model) pagedExperts(layer int) ExpertWeights {
	if ew, ok := m.weights.(ExpertWeights); ok && ew.PagesExperts(layer) {
		return ew
	}
	return nil
}

// guesses are a session's guesses of the experts of its sparse blocks in
// decode steps, and what each block chose last (synthetic routing guesses
// from it).
type guesses struct {
	next     [][]int32 // [block] the experts guessed for the block at position nextPos[block]
	nextPos  []int
	last     [][]int32 // [block] the experts the block chose at position lastPos[block]
	lastPos  []int
	prefetch []int // scratch: the guess as PrefetchExperts takes it
}

func (s *Session) guessState() *guesses {
	if s.guesses == nil {
		n, k := s.m.cfg.NumLayers, s.m.cfg.MoE.ExpertsPerToken
		g := &guesses{next: make([][]int32, n), nextPos: make([]int, n), last: make([][]int32, n), lastPos: make([]int, n), prefetch: make([]int, k)}
		for i := range n {
			g.next[i], g.last[i] = make([]int32, k), make([]int32, k)
			g.nextPos[i], g.lastPos[i] = -1, -1
		}
		s.guesses = g
	}
	return s.guesses
}

// scoreGuess counts how many of the experts guessed for block i at this
// decode step it chose (chosen, the last token's), and remembers chosen.
func (s *Session) scoreGuess(i, T, pos0 int, chosen []int32) {
	g := s.guessState()
	pos := pos0 + T - 1
	if T == 1 && g.nextPos[i] == pos {
		right := 0
		for _, e := range g.next[i] {
			if taken(chosen, e) {
				right++
			}
		}
		s.m.countGuess(i, len(g.next[i]), right)
	}
	g.nextPos[i] = -1
	copy(g.last[i], chosen)
	g.lastPos[i] = pos
}

// countGuess counts a guess of n experts for block i, right of them then
// chosen: in the model's totals (ExpertGuesses) and its record of each
// block's (guessRecord).
func (m *Model) countGuess(i, n, right int) {
	m.guessed.Add(int64(n))
	m.guessRight.Add(int64(right))
	m.guessRecord.add(i, n, right)
}

// guessRecord keeps, for each sparse block, how many of the experts
// guessed for it lately it then chose: counts that decay by guessDecay at
// each guess scored, so that they follow the last dozen or so. Sessions
// of the model add to it together.
type guessRecord struct {
	mu           sync.Mutex
	right, total []float64 // [block] decayed counts of experts right and guessed
	scored       []int     // [block] guesses scored
}

const (
	// guessDecay weighs a block's guesses: each one scored multiplies the
	// earlier ones' counts by it.
	guessDecay = 0.9
	// guessWarmUp is the guesses a block prefetches before its accuracy
	// decides.
	guessWarmUp = 8
)

// add counts a guess of n experts for block i, right of them chosen.
func (g *guessRecord) add(i, n, right int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if i >= len(g.total) {
		g.right = append(g.right, make([]float64, i+1-len(g.right))...)
		g.total = append(g.total, make([]float64, i+1-len(g.total))...)
		g.scored = append(g.scored, make([]int, i+1-len(g.scored))...)
	}
	g.right[i] = g.right[i]*guessDecay + float64(right)
	g.total[i] = g.total[i]*guessDecay + float64(n)
	g.scored[i]++
}

// worthPrefetching reports whether block i's guesses are worth
// prefetching: during its first guessWarmUp guesses, then while at least
// half of the experts guessed lately were chosen. A prefetch that guesses
// wrong takes the link for a whole expert's copy and evicts a cached one
// (the next block's misses queue behind it), and one that guesses right
// saves at most that copy, so below one in two they cost more than they
// give: under uniform routing a guess is right by chance (k of E: 26% for
// Mixtral-8x7B, where 1.1 GiB a token of its 16.7 were such prefetches on
// the H200). Guesses go on being made and scored while their prefetches
// are held, so a block whose routing turns predictable prefetches again.
func (g *guessRecord) worthPrefetching(i int) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if i >= len(g.total) || g.scored[i] < guessWarmUp {
		return true
	}
	return 2*g.right[i] >= g.total[i]
}

// expertGuess is the experts guessed for a sparse block's layer, for the
// caller to prefetch; nil experts when there is no guess.
type expertGuess struct {
	block, layer int
	experts      []int
}

// guessNext guesses, in a decode step at pos0, the experts of the next
// sparse block of the model's share after block i, when its experts are
// paged, for the caller to prefetch once this block's misses are on their
// way (moe). The guess is the next block's router applied
// to this block's hidden state h (its k best scores); a block's router
// weights are resident (the planner keeps them so, paging.WithExpertCache),
// and its experts load while this block computes. Under synthetic routing
// the router does not choose, so the guess is what the next block chose
// at the position before (which synthetic routing keeps with its
// locality).
func (s *Session) guessNext(ctx context.Context, ew ExpertWeights, i, pos0 int) (expertGuess, error) {
	m, c := s.m, &s.m.cfg
	j := i + 1
	for j < m.hi && !c.Sparse(j) {
		j++
	}
	if j >= m.hi {
		return expertGuess{}, nil
	}
	layer := m.blockLayer(j)
	if !ew.PagesExperts(layer) || ew.ExpertSlots() >= m.shareExperts() {
		return expertGuess{}, nil // no experts paged there, or every one stays cached
	}
	if s.batch != nil {
		return s.guessNextBatch(ctx, ew, j)
	}
	g := s.guessState()
	guess := g.next[j]
	if m.synth != nil {
		if g.lastPos[j] != pos0-1 {
			return expertGuess{}, nil
		}
		copy(guess, g.last[j])
	} else {
		b, mb, E := m.backend, s.buffers.moe, c.MoE.Experts
		err := func() error {
			rw, err := ew.AcquireResident(ctx, layer)
			if err != nil {
				return err
			}
			defer m.weights.Release(layer) // released even if the backend panics
			scores := mb.view(mb.scores, 0, 1, E)
			if err := b.MatMul(scores, s.viewsFor(1).h, rw[m.names[layer][arch.Router]], nil); err != nil {
				return err
			}
			return tensor.DownloadComputed(b, mb.r.rawGuess, scores)
		}()
		if err != nil {
			return expertGuess{}, fmt.Errorf("block %d router: %w", j, err)
		}
		topK(f32s(mb.r.rawGuess), guess)
	}
	g.nextPos[j] = pos0
	for k, e := range guess {
		g.prefetch[k] = int(e)
	}
	return expertGuess{j, layer, g.prefetch}, nil
}

// batchDecode reports whether the session runs a batch step of T rows
// that are each one sequence's decode token (no prompt chunk among them):
// the steps whose next sparse block's experts are guessed.
func (s *Session) batchDecode(T int) bool {
	return s.batch != nil && len(s.batch.seqs) == T && s.m.synth == nil
}

// batchGuess is a batch session's guess of a sparse block's experts in a
// decode step: the union over its rows of each row's k best scores of the
// block's router applied to the row's hidden state at the block before.
type batchGuess struct {
	raw   []byte  // [rows, experts] the router's scores, downloaded
	rows  []int32 // scratch: a row's k best
	set   [][]int // [block] the experts guessed, ascending; nil when none
	valid []bool  // [block] guessed in this step, not yet scored
}

func (s *Session) batchGuessState() *batchGuess {
	if s.batchGuess == nil {
		c := &s.m.cfg
		chunk := s.buffers.moe.rows.Shape()[0]
		s.batchGuess = &batchGuess{raw: make([]byte, 4*chunk*c.MoE.Experts), rows: make([]int32, c.MoE.ExpertsPerToken),
			set: make([][]int, c.NumLayers), valid: make([]bool, c.NumLayers)}
	}
	return s.batchGuess
}

// guessNextBatch guesses, in a batch decode step, the experts of sparse
// block j from the next block's router over the T rows of h (each row's k
// best, together), as guessNext does for one sequence.
func (s *Session) guessNextBatch(ctx context.Context, ew ExpertWeights, j int) (expertGuess, error) {
	m, c := s.m, &s.m.cfg
	b, mb, E, k := m.backend, s.buffers.moe, c.MoE.Experts, c.MoE.ExpertsPerToken
	T := len(s.batch.seqs)
	layer := m.blockLayer(j)
	bg := s.batchGuessState()
	err := func() error {
		rw, err := ew.AcquireResident(ctx, layer)
		if err != nil {
			return err
		}
		defer m.weights.Release(layer) // released even if the backend panics
		scores := mb.view(mb.scores, 0, T, E)
		if err := s.matMul(scores, s.viewsFor(T).h, rw[m.names[layer][arch.Router]], nil); err != nil {
			return err
		}
		return tensor.DownloadComputed(b, bg.raw[:4*T*E], scores)
	}()
	if err != nil {
		return expertGuess{}, fmt.Errorf("block %d router: %w", j, err)
	}
	all := f32s(bg.raw[:4*T*E])
	set := bg.set[j][:0]
	for t := range T {
		topK(all[t*E:(t+1)*E], bg.rows[:k])
		for _, e := range bg.rows[:k] {
			if !slices.Contains(set, int(e)) {
				set = append(set, int(e))
			}
		}
	}
	slices.Sort(set)
	bg.set[j], bg.valid[j] = set, true
	return expertGuess{j, layer, set}, nil
}

// scoreBatchGuess counts, in a batch step, the experts guessed for block
// i in this step and how many of them its rows chose.
func (s *Session) scoreBatchGuess(i int) {
	if s.batchGuess == nil {
		return
	}
	if first := s.m.firstSparse(); i == first {
		// A new step: a guess left by a step that failed midway is stale.
		clear(s.batchGuess.valid)
	}
	if !s.batchGuess.valid[i] {
		return
	}
	bg, r := s.batchGuess, &s.buffers.moe.r
	bg.valid[i] = false
	right := 0
	for _, e := range bg.set[i] {
		if r.count[e] > 0 {
			right++
		}
	}
	s.m.countGuess(i, len(bg.set[i]), right)
}

// firstSparse is the first sparse block of the model's share, or hi.
func (m *Model) firstSparse() int {
	i := m.lo
	for i < m.hi && !m.cfg.Sparse(i) {
		i++
	}
	return i
}

// shareExperts is the number of routed experts in the model's share of
// the blocks.
func (m *Model) shareExperts() int {
	n := 0
	for i := m.lo; i < m.hi; i++ {
		if m.cfg.Sparse(i) {
			n += m.cfg.MoE.Experts
		}
	}
	return n
}

// SparseTimes is the host's time in the sparse blocks of a model's
// sessions: in Blocks of them, RouterWait waiting for their routers'
// scores (the device's work queued before, and the copies it waits on),
// and Host the rest, from the scores to the block's last operation queued
// (routing, the experts' copies queued, the launches, the CPU's experts).
// Where the copies of a block's misses bound decode, RouterWait holds
// them and Host is what the link may idle for.
type SparseTimes struct {
	Blocks           int64
	RouterWait, Host time.Duration
}

type sparseCounters struct {
	blocks, wait, host atomic.Int64
}

// add counts a block whose router's scores were waited for from t0 to t1
// (zero when the block failed before them) and which ended now.
func (c *sparseCounters) add(t0, t1 time.Time) {
	if t1.IsZero() {
		return
	}
	c.blocks.Add(1)
	c.wait.Add(int64(t1.Sub(t0)))
	c.host.Add(int64(time.Since(t1)))
}

// SparseTimes returns the host's time in the model's sparse blocks so far.
func (m *Model) SparseTimes() SparseTimes {
	c := &m.sparse
	return SparseTimes{Blocks: c.blocks.Load(), RouterWait: time.Duration(c.wait.Load()), Host: time.Duration(c.host.Load())}
}

// ExpertGuesses returns how many experts the model's sessions guessed for
// the next sparse block in decode steps (the prefetch of paged experts)
// and how many of those the block then chose.
func (m *Model) ExpertGuesses() (guessed, right int64) {
	return m.guessed.Load(), m.guessRight.Load()
}

// scaleRows multiplies row r of x [n, width] (width even) by row pos0+r of
// the table w [rows, 1], zero being a zero table of w's shape: Rope over
// heads of size 2 whose angle has that cosine and a zero sine, which
// computes (a·w - b·0, b·w + a·0) for each pair of columns, exactly a·w and
// b·w.
func scaleRows(b tensor.Backend, x, w, zero *tensor.Tensor, pos0 int) error {
	return b.Rope(x, tensor.Rotary{Cos: w, Sin: zero, Heads: x.Shape()[1] / 2, HeadDim: 2, Pos0: pos0})
}

// synthRouter draws the experts of arch.SyntheticRouting: for each block,
// an order of the experts whose ranks have Zipf popularity, and for each
// position and slot a draw that is kept from the previous position with
// probability Locality. Every draw is a hash of the seed, the block, the
// slot and the position, so a position's experts do not depend on how the
// sequence was cut into chunks.
type synthRouter struct {
	syn   arch.SyntheticRouting
	cdf   [][]float64 // [block][rank] the popularity of ranks 0..rank, the last 1
	order [][]int32   // [block][rank] the expert of each rank
}

func newSynthRouter(c *arch.Config) *synthRouter {
	m := c.MoE
	if m == nil || m.Synthetic == nil {
		return nil
	}
	g := &synthRouter{syn: *m.Synthetic}
	E := m.Experts
	for block := range c.NumLayers {
		order := make([]int32, E)
		for e := range order {
			order[e] = int32(e)
		}
		for e := E - 1; e > 0; e-- { // Fisher-Yates
			j := int(hashKeys(g.syn.Seed, uint64(block), 0, uint64(e)) % uint64(e+1))
			order[e], order[j] = order[j], order[e]
		}
		cdf := make([]float64, E)
		total := 0.0
		for r := range cdf {
			total += math.Pow(float64(r+1), -g.syn.Skew)
			cdf[r] = total
		}
		for r := range cdf {
			cdf[r] /= total
		}
		cdf[E-1] = 1
		g.order, g.cdf = append(g.order, order), append(g.cdf, cdf)
	}
	return g
}

// pick fills ex with the distinct experts of the token at position pos in
// block.
func (g *synthRouter) pick(block, pos int, ex []int32) {
	seed, b := g.syn.Seed, uint64(block)
	for j := range ex {
		// The last position up to pos where slot j drew anew.
		q := pos
		for q > 0 && unitFloat(hashKeys(seed, b, 1, uint64(j), uint64(q))) < g.syn.Locality {
			q--
		}
		for a := 0; ; a++ {
			var e int32
			if a < 64 {
				u := unitFloat(hashKeys(seed, b, 2+uint64(a), uint64(j), uint64(q)))
				r, _ := slices.BinarySearch(g.cdf[block], u)
				e = g.order[block][min(r, len(g.order[block])-1)]
			} else { // a popular expert the earlier slots hold: the first free one
				for e = 0; taken(ex[:j], e); e++ {
				}
			}
			if !taken(ex[:j], e) {
				ex[j] = e
				break
			}
		}
	}
}

// hashKeys mixes keys into 64 random bits (splitmix64's finaliser over each
// key in turn).
func hashKeys(keys ...uint64) uint64 {
	h := uint64(0x9e3779b97f4a7c15)
	for _, k := range keys {
		h ^= k + 0x9e3779b97f4a7c15 + h<<6 + h>>2
		h = (h ^ h>>30) * 0xbf58476d1ce4e5b9
		h = (h ^ h>>27) * 0x94d049bb133111eb
		h ^= h >> 31
	}
	return h
}

// unitFloat maps 64 random bits to [0, 1).
func unitFloat(h uint64) float64 { return float64(h>>11) / (1 << 53) }
