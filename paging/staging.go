package paging

import (
	"context"
	"errors"
	"fmt"
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
// A load takes a free buffer (waiting, in order, when none is), reads the
// part's tensors into it on up to stagingReaders goroutines (a large
// tensor of a RangeSource in pieces of stagingPiece bytes), and queues
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
// The ring's bytes are host memory charged to the pager's host limit
// (Options.HostCacheBytes) before the host cache's; the plan of the
// aggressive strategy, which keeps no host cache, adds them to its host
// memory (PlanResult.StagingBytes).

// maxStagingSlots bounds the staging ring's buffers: one per load that
// runs at once (the layer acquired and its prefetch depth), at most three.
const maxStagingSlots = 3

// stagingSlots is the staging ring's buffers for a prefetch depth.
func stagingSlots(depth int) int { return min(max(depth, 0)+1, maxStagingSlots) }

// stagingReaders bounds the goroutines reading one part into its staging
// buffer: a read from the page cache runs at 5-10 GB/s on one thread, a
// copy over the link at up to 50, so several read at once.
const stagingReaders = 8

// stagingPiece is the size of the pieces a RangeSource's tensors are read
// and copied in (whole rows, at least one): a 7B model's MLP projections
// (86 MiB) in six, its embedding table (250 MiB) in sixteen.
const stagingPiece = 16 << 20

// staging is the staging ring.
type staging struct {
	up    tensor.StagedUploader
	size  int64    // each buffer's bytes
	piece int64    // the bytes of a piece read from a RangeSource (stagingPiece)
	bufs  [][]byte // every buffer, for Close
	free  chan []byte
	// returns runs the goroutines that give a buffer back once its copies
	// have landed.
	returns sync.WaitGroup
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
	s := &staging{up: up, size: size, piece: stagingPiece}
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
	p.stage, p.stageBytes = s, int64(len(s.bufs))*size
	p.hostCap += min(planned, p.stageBytes)
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
	start := time.Now()
	var buf []byte
	select {
	case buf = <-s.free:
	case <-ctx.Done():
		return fmt.Errorf("paging: layer %d: waiting for a staging buffer: %w", e.layer, ctx.Err())
	}
	waited := time.Since(start)
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pieces := s.pieces(e, p.src)
	jobs := make(chan stagePiece, len(pieces))
	for _, pc := range pieces {
		jobs <- pc
	}
	close(jobs)
	type readDone struct {
		pc  stagePiece
		err error
	}
	rs, ranged := p.src.(RangeSource)
	results := make(chan readDone, len(pieces))
	for range min(stagingReaders, len(pieces)) {
		go func() {
			for pc := range jobs {
				sp := e.specs[e.str[pc.k]]
				dst := buf[e.strOff[pc.k]+pc.off : e.strOff[pc.k]+pc.off+pc.n]
				err := rctx.Err()
				switch {
				case err != nil:
				case ranged && pc.n < sp.Bytes:
					err = rs.ReadTensorRange(rctx, e.layer, sp.Name, pc.off, dst)
				default:
					err = p.src.ReadTensor(rctx, e.layer, sp.Name, dst)
				}
				if err != nil {
					err = fmt.Errorf("paging: layer %d tensor %s: reading: %w", e.layer, sp.Name, err)
				}
				results <- readDone{pc, err}
			}
		}()
	}
	var landed []func() error
	var err error
	nReady := len(ld.ready)
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

// stagePiece is a piece of a streamed tensor read into a staging buffer
// and copied on its own: n bytes at off of e.str[k].
type stagePiece struct {
	k      int
	off, n int64
}

// pieces splits e's streamed tensors, the largest first, into the pieces
// they are read and copied in: whole tensors, or, from a RangeSource,
// pieces of whole rows of about s.piece bytes.
func (s *staging) pieces(e *entry, src Source) []stagePiece {
	_, ranged := src.(RangeSource)
	var out []stagePiece
	for _, k := range e.strBySize {
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
	s.returns.Wait()
	var errs []error
	for _, b := range s.bufs {
		if err := pa.FreePinned(b); err != nil {
			errs = append(errs, fmt.Errorf("paging: freeing a staging buffer: %w", err))
		}
	}
	s.bufs = nil
	return errors.Join(errs...)
}
