package paging

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// The staging ring: a few pinned host buffers, each the size of the
// largest streamed part, that the streamed parts the host cache does not
// keep are read into on their way to the device. Without it such a part
// (every part, under the aggressive strategy) was read into pageable
// memory by one goroutine and copied synchronously at the pageable rate,
// and neither the read nor the copy overlapped anything.
//
// A load takes a free buffer (waiting, in order, when none is), has the
// part's tensors read into it by the ring's readers (a large tensor of a
// RangeSource in pieces of stagingPiece bytes; the readers serve the loads
// in the order they were queued), and queues
// each tensor's or piece's copy on the backend's copy stream as soon as
// its read is done (tensor.StagedUploader), so that the first copies run
// while the rest is read. The copies' ready waits go with the layer,
// as every asynchronous upload's do; their landed waits go to a goroutine
// that gives the buffer back once every copy out of it has landed, so a
// buffer is never refilled under a copy still reading it, and the load
// does not wait for its copies. With prefetch the loads of the next
// layers run, each in a buffer of its own, while the current layer
// computes: a cyclic walk then takes about the longest of the read, the
// copy and the compute per layer, not their sum.
//
// A read from the page cache into a buffer moves every byte through the
// CPU (read and write) while the copy engine reads it again: on the H200
// host the reads, not the link, bounded the ring (35.7 GB/s of 53.8 from
// memory in TestPagerStagedGPU, about 25 from the model's files). From a
// MappedSource (weight files mapped read-only) on a backend that can
// page-lock host memory (tensor.HostRegistrar), the ring page-locks the
// mappings once and queues the copy of each tensor the source gives in
// place straight from the page cache: no read, no buffer, the CPU moves
// nothing; the tensors it does not give (rows reordered on reading) go
// through the buffers as before.
//
// The ring's bytes are host memory charged to the pager's host limit
// (Options.HostCacheBytes) before the host cache's; the plan of the
// aggressive strategy, which keeps no host cache, adds them to its host
// memory (PlanResult.StagingBytes). The page-locked mappings are the page
// cache's pages, not allocated (Stats.MappedBytes).

// maxStagingSlots bounds the staging ring's buffers: one per load that
// runs at once (the layer acquired and its prefetch depth), at most three.
const maxStagingSlots = 3

// stagingSlots is the staging ring's buffers for a prefetch depth.
func stagingSlots(depth int) int { return min(max(depth, 0)+1, maxStagingSlots) }

// stagingReaders is the default of the goroutines reading streamed parts
// into the staging ring, for every load at once
// (Options.StagingReaders): one per core the process may use, at least
// eight (reads from a disk wait more than they copy). A read from the
// page cache runs at 5-10 GB/s on one thread, a copy over the link at up
// to 55, so several read at once.
func stagingReaders() int { return max(runtime.GOMAXPROCS(0), 8) }

// stagingPiece is the default size of the pieces a RangeSource's tensors
// are read and copied in (Options.StagingPiece; whole rows, at least
// one): a 7B model's MLP projections (86 MiB) in six, its embedding table
// (250 MiB) in sixteen.
const stagingPiece = 16 << 20

// staging is the staging ring.
type staging struct {
	up    tensor.StagedUploader
	size  int64    // each buffer's bytes
	piece int64    // the bytes of a piece read from a RangeSource
	bufs  [][]byte // every buffer, for Close
	free  chan []byte
	// returns runs the goroutines that give a buffer back once its copies
	// have landed.
	returns sync.WaitGroup

	// The readers: goroutines shared by every load, which take the
	// pieces of the loads queued in the order the loads were queued, so
	// that the load queued first (the layer needed first) is read first
	// and its copies are queued before the next load's, not interleaved
	// with them.
	read     func(ld *stageLoad, pc stagePiece) error
	nreaders int
	readers  sync.WaitGroup
	mu       sync.Mutex
	cond     *sync.Cond
	queue    []*stageLoad
	closing  bool
	// mapped is the source whose tensors are copied in place, when its
	// regions were page-locked (unregister undoes that); nil otherwise.
	// Then the buffers are pinned at the first load that needs one: lazy
	// of them are left to pin, by pa.
	mapped      MappedSource
	unregister  []func() error
	mappedBytes int64
	lazyMu      sync.Mutex
	lazy        int
	pa          tensor.PinnedAllocator
	bufsMu      sync.Mutex // guards bufs while buffers are pinned lazily

	active int           // reads under way
	since  time.Time     // when active last became > 0
	busy   time.Duration // the time with at least one read under way
}

// stageLoad is a load's pieces queued for the readers; each piece's read
// ends with a readDone on results, which holds them all.
type stageLoad struct {
	ctx     context.Context
	e       *entry
	buf     []byte
	pieces  []stagePiece
	next    int // the first piece not taken by a reader
	results chan readDone
}

type readDone struct {
	pc  stagePiece
	err error
}

// startReaders starts n readers.
func (s *staging) startReaders(n int) {
	s.cond = sync.NewCond(&s.mu)
	s.nreaders = max(n, 1)
	for range s.nreaders {
		s.readers.Add(1)
		go s.reader()
	}
}

// enqueue queues ld's pieces behind the loads queued before.
func (s *staging) enqueue(ld *stageLoad) {
	if len(ld.pieces) == 0 {
		return
	}
	s.mu.Lock()
	s.queue = append(s.queue, ld)
	s.mu.Unlock()
	s.cond.Broadcast()
}

// reader reads the queued pieces, oldest load first, until the ring
// closes and the queue is empty. A piece of a load whose context is done
// is not read: its result is the context's error.
func (s *staging) reader() {
	defer s.readers.Done()
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		for len(s.queue) == 0 && !s.closing {
			s.cond.Wait()
		}
		if len(s.queue) == 0 {
			return
		}
		ld := s.queue[0]
		pc := ld.pieces[ld.next]
		if ld.next++; ld.next == len(ld.pieces) {
			s.queue[0] = nil
			s.queue = s.queue[1:]
		}
		if s.active == 0 {
			s.since = time.Now()
		}
		s.active++
		s.mu.Unlock()
		err := ld.ctx.Err()
		if err == nil {
			err = s.read(ld, pc)
		}
		ld.results <- readDone{pc, err} // never blocks: it holds every piece
		s.mu.Lock()
		if s.active--; s.active == 0 {
			s.busy += time.Since(s.since)
		}
	}
}

// readTime is the time so far with at least one read under way.
func (s *staging) readTime() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.busy
	if s.active > 0 {
		d += time.Since(s.since)
	}
	return d
}

// newStaging sets up the staging ring, when the backend has pinned
// memory and staged uploads and the host cache cannot keep every streamed
// part: slots buffers of the largest streamed part (stagingSlots of the
// prefetch depth unless Options.StagingSlots says otherwise), as many as
// the plan's staging bytes (planned, when the host limit is the plan's)
// and the host limit have room for beside the host layers. The host limit
// grows by what the ring takes of planned. A buffer the backend
// cannot pin is left out; none leaves the pager without staging. NewPager
// calls it before the pager is shared.
func (p *Pager) newStaging(opts Options, planned int64) {
	up, ok := tensor.StagedUpload(p.b)
	if !ok || p.pinned == nil || opts.StagingSlots < 0 {
		return
	}
	var size, streamed int64
	for _, e := range p.layers {
		if len(e.str) == 0 || e.held {
			continue
		}
		size = max(size, e.hostSize)
		streamed += e.hostSize
	}
	room := p.hostCap - p.hostReserved
	if size == 0 || streamed <= room {
		return // nothing streams, or the host cache keeps it all
	}
	room += planned
	slots := stagingSlots(p.depth)
	if opts.StagingSlots > 0 {
		slots = opts.StagingSlots
	}
	slots = int(min(int64(slots), room/size))
	piece := int64(stagingPiece)
	if opts.StagingPiece > 0 {
		piece = opts.StagingPiece
	}
	s := &staging{up: up, size: size, piece: piece}
	for range slots {
		b, err := p.pinned.AllocPinned(size)
		if err != nil {
			break
		}
		if int64(len(b)) != size {
			_ = p.pinned.FreePinned(b)
			break
		}
		s.bufs = append(s.bufs, b)
	}
	if len(s.bufs) == 0 {
		return
	}
	s.free = make(chan []byte, len(s.bufs))
	for _, b := range s.bufs {
		s.free <- b
	}
	s.read = p.readPiece
	p.stage, p.stageBytes = s, int64(len(s.bufs))*size
	p.hostCap += min(planned, p.stageBytes)
	if ms, ok := p.src.(MappedSource); ok && !opts.NoMappedUploads {
		s.register(p.b, ms)
	}
	if s.mapped != nil {
		// Copied in place, most parts need no buffer: the buffers are
		// pinned again when a load first needs one, within the room
		// they keep charged to the host limit.
		s.lazy, s.pa = len(s.bufs), p.pinned
		for range s.bufs {
			_ = p.pinned.FreePinned(<-s.free)
		}
		s.bufs = nil
	}
	readers := stagingReaders()
	if opts.StagingReaders > 0 {
		readers = opts.StagingReaders
	}
	s.startReaders(readers)
}

// take returns a free buffer, waiting in order when none is; with buffers
// left to pin (lazy), it pins them all at the first need.
func (s *staging) take(ctx context.Context) ([]byte, error) {
	if err := s.pinLazy(); err != nil {
		return nil, err
	}
	select {
	case buf := <-s.free:
		return buf, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// pinLazy pins the buffers left to pin, if any; they go to the free ones.
func (s *staging) pinLazy() error {
	s.lazyMu.Lock()
	defer s.lazyMu.Unlock()
	for s.lazy > 0 {
		b, err := s.pa.AllocPinned(s.size)
		if err == nil && int64(len(b)) != s.size {
			_ = s.pa.FreePinned(b)
			err = fmt.Errorf("got %d bytes, not %d", len(b), s.size)
		}
		if err != nil {
			if len(s.bufs) > 0 {
				s.lazy = 0 // make do with those pinned
				return nil
			}
			return fmt.Errorf("pinning a staging buffer: %w", err)
		}
		s.lazy--
		s.bufsMu.Lock()
		s.bufs = append(s.bufs, b)
		s.bufsMu.Unlock()
		s.free <- b
	}
	return nil
}

// pinnedBufs is the buffers pinned now.
func (s *staging) pinnedBufs() int {
	s.bufsMu.Lock()
	defer s.bufsMu.Unlock()
	return len(s.bufs)
}

// register page-locks ms's regions on b, when b can (tensor.HostRegistrar),
// so that loads copy ms's mapped tensors in place. When one fails, those
// done are undone and every tensor is read as before.
func (s *staging) register(b tensor.Memory, ms MappedSource) {
	if undo, n := registerMapped(b, ms); len(undo) > 0 {
		s.unregister, s.mapped, s.mappedBytes = undo, ms, n
	}
}

// registerMapped page-locks ms's regions on b, when b can
// (tensor.HostRegistrar): the unregistrations to run once the copies from
// them have landed, and the bytes locked. When one fails, those done are
// undone and it returns none.
func registerMapped(b tensor.Memory, ms MappedSource) (undo []func() error, n int64) {
	reg, ok := tensor.HostRegister(b)
	if !ok {
		return nil, 0
	}
	for _, r := range ms.MappedRegions() {
		if len(r) == 0 {
			continue
		}
		un, err := reg.RegisterHost(r)
		if err != nil {
			for _, u := range undo {
				_ = u()
			}
			return nil, 0
		}
		undo, n = append(undo, un), n+int64(len(r))
	}
	return undo, n
}

// stages reports whether a load of e's streamed part that the host cache
// does not keep goes through the staging ring.
func (p *Pager) stages(e *entry) bool { return p.stage != nil && e.hostSize <= p.stage.size }

// uploadStaged fills ts, the device tensors of e's streamed part, through
// a staging buffer (see staging). The copies' ready waits are appended to
// ld.ready. On an error the waits of the copies queued have run, the
// buffer goes back once they have landed, and ts are the caller's.
func (p *Pager) uploadStaged(ctx context.Context, e *entry, ts []*tensor.Tensor, ld *loadState) error {
	s := p.stage
	nReady := len(ld.ready)
	// Tensors in place in a page-locked mapping: copied from there.
	var inPlace []bool
	if s.mapped != nil {
		inPlace = make([]bool, len(e.str))
		left := 0
		for k, i := range e.str {
			sp := e.specs[i]
			b, ok, err := s.mapped.MappedTensor(e.layer, sp.Name)
			if err == nil && ok && int64(len(b)) != sp.Bytes {
				err = fmt.Errorf("mapped in %d bytes, not %d", len(b), sp.Bytes)
			}
			if err == nil && ok {
				var ready func() error
				if ready, err = s.up.UploadAsync(ctx, ts[k], 0, b); err == nil {
					ld.ready = append(ld.ready, ready)
					ld.moved += sp.Bytes
					p.mu.Lock()
					p.st.BytesHostToDevice += sp.Bytes
					p.st.BytesMapped += sp.Bytes
					p.mu.Unlock()
					inPlace[k] = true
					continue
				}
			}
			if err != nil {
				for _, r := range ld.ready[nReady:] {
					_ = r()
				}
				ld.ready = ld.ready[:nReady]
				return fmt.Errorf("paging: layer %d tensor %s: copying in place: %w", e.layer, sp.Name, err)
			}
			left++
		}
		if left == 0 {
			return nil
		}
	}
	start := time.Now()
	buf, err := s.take(ctx)
	if err != nil {
		for _, r := range ld.ready[nReady:] {
			_ = r()
		}
		ld.ready = ld.ready[:nReady]
		return fmt.Errorf("paging: layer %d: waiting for a staging buffer: %w", e.layer, err)
	}
	waited := time.Since(start)
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pieces := s.pieces(e, p.src, inPlace)
	results := make(chan readDone, len(pieces))
	s.enqueue(&stageLoad{ctx: rctx, e: e, buf: buf, pieces: pieces, results: results})
	var landed []func() error
	for range pieces {
		r := <-results
		if err != nil {
			continue // draining the readers
		}
		if r.err != nil {
			err = r.err
			cancel()
			continue
		}
		pc := r.pc
		sp := e.specs[e.str[pc.k]]
		src := buf[e.strOff[pc.k]+pc.off : e.strOff[pc.k]+pc.off+pc.n]
		ready, land, uerr := s.up.UploadStaged(ctx, ts[pc.k], pc.off, src)
		if uerr != nil {
			err = fmt.Errorf("paging: layer %d tensor %s: upload: %w", e.layer, sp.Name, uerr)
			cancel()
			continue
		}
		ld.ready = append(ld.ready, ready)
		landed = append(landed, land)
		ld.moved += pc.n
		p.mu.Lock()
		p.st.BytesDiskToHost += pc.n
		p.st.BytesHostToDevice += pc.n
		p.st.BytesStaged += pc.n
		p.mu.Unlock()
	}
	p.mu.Lock()
	p.stagingWait += waited
	p.mu.Unlock()
	if err != nil {
		for _, r := range ld.ready[nReady:] {
			_ = r()
		}
		ld.ready = ld.ready[:nReady]
	}
	s.giveBack(buf, landed)
	return err
}

// readPiece reads the piece pc of ld's layer into its place in ld's
// buffer: from a RangeSource when it is part of its tensor.
func (p *Pager) readPiece(ld *stageLoad, pc stagePiece) error {
	e := ld.e
	sp := e.specs[e.str[pc.k]]
	dst := ld.buf[e.strOff[pc.k]+pc.off : e.strOff[pc.k]+pc.off+pc.n]
	var err error
	if rs, ok := p.src.(RangeSource); ok && pc.n < sp.Bytes {
		err = rs.ReadTensorRange(ld.ctx, e.layer, sp.Name, pc.off, dst)
	} else {
		err = p.src.ReadTensor(ld.ctx, e.layer, sp.Name, dst)
	}
	if err != nil {
		return fmt.Errorf("paging: layer %d tensor %s: reading: %w", e.layer, sp.Name, err)
	}
	return nil
}

// stagePiece is a piece of a streamed tensor read into a staging buffer
// and copied on its own: n bytes at off of e.str[k].
type stagePiece struct {
	k      int
	off, n int64
}

// pieces splits e's streamed tensors, the largest first, into the pieces
// they are read and copied in: whole tensors, or, from a RangeSource,
// pieces of whole rows of about s.piece bytes. The tensors marked in
// inPlace (when not nil) are left out: they are copied in place.
func (s *staging) pieces(e *entry, src Source, inPlace []bool) []stagePiece {
	_, ranged := src.(RangeSource)
	var out []stagePiece
	for _, k := range e.strBySize {
		if inPlace != nil && inPlace[k] {
			continue
		}
		sp := e.specs[e.str[k]]
		step := sp.Bytes
		if ranged && len(sp.Shape) > 1 && sp.Bytes > s.piece {
			if rows := int64(sp.Shape[0]); sp.Bytes%rows == 0 {
				row := sp.Bytes / rows
				step = max(1, s.piece/row) * row
			}
		}
		if step == 0 { // an empty tensor: one empty piece
			out = append(out, stagePiece{k: k})
			continue
		}
		for off := int64(0); off < sp.Bytes; off += step {
			out = append(out, stagePiece{k: k, off: off, n: min(step, sp.Bytes-off)})
		}
	}
	return out
}

// giveBack returns buf to the free buffers once the copies out of it have
// landed. A copy that failed has stopped reading it all the same; its
// error reaches the layer's user through the copy's ready wait.
func (s *staging) giveBack(buf []byte, landed []func() error) {
	if len(landed) == 0 {
		s.free <- buf
		return
	}
	s.returns.Add(1)
	go func() {
		defer s.returns.Done()
		for _, l := range landed {
			_ = l()
		}
		s.free <- buf
	}()
}

// close waits for every buffer to come back and frees them. The pager's
// loads have ended.
func (s *staging) close(pa tensor.PinnedAllocator) error {
	s.mu.Lock()
	s.closing = true
	s.mu.Unlock()
	s.cond.Broadcast()
	s.readers.Wait()
	s.returns.Wait()
	var errs []error
	for _, u := range s.unregister { // waits for the copies from the mapping
		if err := u(); err != nil {
			errs = append(errs, fmt.Errorf("paging: unregistering a mapped weight file: %w", err))
		}
	}
	s.unregister, s.mapped = nil, nil
	for _, b := range s.bufs {
		if err := pa.FreePinned(b); err != nil {
			errs = append(errs, fmt.Errorf("paging: freeing a staging buffer: %w", err))
		}
	}
	s.bufs = nil
	return errors.Join(errs...)
}
