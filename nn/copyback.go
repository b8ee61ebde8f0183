package nn

import (
	"errors"
	"sync"

	"github.com/strata-llm/strata/tensor"
)

// copyBack tracks the copies of a device's twin scratch pair back to the
// host (tensor.AsyncDownloader) that have not landed: each twin block
// queues its keys' and values' copies and goes on; the next twin block on
// the device orders its compute after them (order) before it overwrites
// the pair, and the chunk waits for them all (land) before the host reads
// the KV cache or the chunk returns. Without it a block's copy-back waited
// for the block's compute and the copy, twice a block, and the host queued
// the next block only then.
type copyBack struct {
	mu     sync.Mutex
	ready  []func() error // compute waits not yet queued
	landed []func() error // host waits not yet made
}

// queue queues the copy of src into dst.
func (c *copyBack) queue(ad tensor.AsyncDownloader, dst []byte, src *tensor.Tensor) error {
	ready, landed, err := ad.DownloadAsync(dst, src)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.ready, c.landed = append(c.ready, ready), append(c.landed, landed)
	c.mu.Unlock()
	return nil
}

// order makes the device's compute queued from now on wait for the copies
// queued so far. It is safe on a nil copyBack.
func (c *copyBack) order() error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	ready := c.ready
	c.ready = nil
	c.mu.Unlock()
	var errs []error
	for _, r := range ready {
		errs = append(errs, r())
	}
	return errors.Join(errs...)
}

// land waits until every copy queued has landed in host memory and
// returns their first errors; the compute waits not yet queued are
// queued first (each wait is called once, as the backend asks). It is safe
// on a nil copyBack.
func (c *copyBack) land() error {
	if c == nil {
		return nil
	}
	err := c.order()
	c.mu.Lock()
	landed := c.landed
	c.landed = nil
	c.mu.Unlock()
	errs := []error{err}
	for _, l := range landed {
		errs = append(errs, l())
	}
	return errors.Join(errs...)
}
