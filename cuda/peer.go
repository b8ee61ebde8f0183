//go:build cuda

package cuda

import (
	"errors"
	"fmt"

	"github.com/strata-llm/strata/tensor"
	"gorgonia.org/cu"
)

// asBackend finds the *Backend behind m (a Checked front, say), or nil.
func asBackend(m tensor.Memory) *Backend {
	for m != nil {
		if b, ok := m.(*Backend); ok {
			return b
		}
		u, ok := m.(interface{ Unwrap() tensor.Backend })
		if !ok {
			return nil
		}
		m = u.Unwrap()
	}
	return nil
}

// CanCopyToPeer reports whether to is another CUDA device of this process
// that b's device and it can read from each other (cuDeviceCanAccessPeer
// both ways); the first call for a pair enables peer access in both
// contexts. Devices that cannot (no NVLink or PCIe peer path, a
// virtualised GPU) hand over through host memory instead.
func (b *Backend) CanCopyToPeer(to tensor.Memory) bool {
	p := asBackend(to)
	if p == nil || p == b || p.ordinal == b.ordinal {
		return false
	}
	b.peerMu.Lock()
	defer b.peerMu.Unlock()
	if can, ok := b.peerCan[p]; ok {
		return can
	}
	can := b.enablePeer(p) == nil
	if b.peerCan == nil {
		b.peerCan = map[*Backend]bool{}
	}
	b.peerCan[p] = can
	return can
}

// PeerAccess enables peer access between b's device and to's, both ways,
// and reports why it cannot when it cannot (CanCopyToPeer says only
// whether): for a test or a tool to log.
func (b *Backend) PeerAccess(to *Backend) error {
	if to == nil || to == b || to.ordinal == b.ordinal {
		return errors.New("cuda: peer access: want two different devices")
	}
	return b.enablePeer(to)
}

// enablePeer checks that each device can access the other and enables
// access in each context to the other's; access already enabled is fine.
func (b *Backend) enablePeer(p *Backend) error {
	for _, d := range [][2]*Backend{{b, p}, {p, b}} {
		from, to := d[0], d[1]
		can, err := from.dev.CanAccessPeer(to.dev)
		if err != nil {
			return fmt.Errorf("cuda: peer access from %s to %s: %w", from.name, to.name, cuError(err))
		}
		if can == 0 {
			return fmt.Errorf("cuda: peer access from %s to %s: the devices cannot access each other", from.name, to.name)
		}
	}
	for _, d := range [][2]*Backend{{b, p}, {p, b}} {
		from, to := d[0], d[1]
		if err := from.enter("peer access"); err != nil {
			return err
		}
		err := to.ctx.EnablePeerAccess(0)
		from.leave()
		if err != nil && err != cu.PeerAccessAlreadyEnabled {
			return fmt.Errorf("cuda: enabling peer access from %s to %s: %w", from.name, to.name, cuError(err))
		}
	}
	return nil
}

// CopyToPeer copies src, a tensor of b, into dst, a tensor of to (another
// CUDA backend that CanCopyToPeer accepted), device to device
// (cuMemcpyPeerAsync on b's compute stream). Events order it: the copy
// waits for the work queued on to before the call (which may still read
// dst) and for b's compute queued before it; to's compute stream waits for
// the copy before the work queued after the call. It returns without
// waiting for the copy.
func (b *Backend) CopyToPeer(to tensor.Memory, dst, src *tensor.Tensor) error {
	const op = "CopyToPeer"
	p := asBackend(to)
	if p == nil {
		return fmt.Errorf("cuda: %s: %s is not a CUDA device", op, to.Name())
	}
	if err := b.device(op, "src", src); err != nil {
		return err
	}
	if err := p.device(op, "dst", dst); err != nil {
		return err
	}
	n := src.NumBytes()
	if dst.NumBytes() != n {
		return fmt.Errorf("cuda: %s: %v (%d bytes) into %v (%d bytes)", op, src, n, dst, dst.NumBytes())
	}
	if n == 0 {
		return nil
	}
	if b.capturing() || p.capturing() {
		return fmt.Errorf("%s: %s: %w", b.name, op, errCapturing)
	}
	// The receiver's work so far, which may read dst.
	before, err := p.recordCompute(op)
	if err != nil {
		return err
	}
	var after cu.Event
	err = b.ops(op, func() error {
		defer p.putEvent(before)
		if err := b.compute.Wait(before, 0); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		b.counts.copies.Add(1)
		if err := cu.MemcpyPeerAsync(cu.DevicePtr(dst.Ptr()), p.ctx, cu.DevicePtr(src.Ptr()), b.ctx, n, b.compute); err != nil {
			return fmt.Errorf("%s: %s to %s: %w", b.name, op, p.name, cuError(err))
		}
		ev, err := b.getEvent()
		if err == nil {
			err = ev.Record(b.compute)
		}
		if err != nil {
			return fmt.Errorf("%s: %s: recording an event: %w", b.name, op, cuError(err))
		}
		after = ev
		return nil
	})
	if err != nil {
		return err
	}
	defer b.putEvent(after)
	return p.ops(op, func() error {
		if err := p.compute.Wait(after, 0); err != nil {
			return fmt.Errorf("%s: %s: waiting for the copy from %s: %w", p.name, op, b.name, cuError(err))
		}
		return nil
	})
}

// recordCompute records an event of b's pool after the work queued on
// its compute stream; give it back with putEvent.
func (b *Backend) recordCompute(op string) (cu.Event, error) {
	var ev cu.Event
	err := b.ops(op, func() error {
		e, err := b.getEvent()
		if err == nil {
			if err = e.Record(b.compute); err != nil {
				b.putEvent(e)
			}
		}
		if err != nil {
			return fmt.Errorf("%s: %s: recording an event: %w", b.name, op, cuError(err))
		}
		ev = e
		return nil
	})
	return ev, err
}
