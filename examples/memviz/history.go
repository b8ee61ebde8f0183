package main

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"

	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/paging"
)

// levels is the charged bytes of each category, in paging's Category order.
type levels [len(categories)]int64

// sample is the charged bytes per category from time t on.
type sample struct {
	t    int64
	cats levels
}

func (s sample) total() int64 {
	var n int64
	for _, v := range s.cats {
		n += v
	}
	return n
}

// bucket holds what is kept of the events of one time span: of the
// samples, the first with the largest total and the last, in time order
// (one sample when they are the same); of the finished loads, one mark per
// layer and outcome.
type bucket struct {
	idx   int64 // the span is [idx*width, (idx+1)*width)
	s     [2]sample
	n     int
	loads []load
}

// add takes a sample later than those the bucket holds.
func (b *bucket) add(s sample) {
	if b.n == 0 || s.total() > b.s[0].total() {
		b.s[0], b.n = s, 1
		return
	}
	b.s[1], b.n = s, 2
}

// addLoad counts l in the mark of its layer and outcome.
func (b *bucket) addLoad(l load) {
	for i := range b.loads {
		if m := &b.loads[i]; m.loadKind == l.loadKind {
			m.t, m.n = min(m.t, l.t), m.n+l.n
			return
		}
	}
	b.loads = append(b.loads, l)
}

// merge takes the samples and loads of a later bucket.
func (b *bucket) merge(o *bucket) {
	for _, s := range o.s[:o.n] {
		b.add(s)
	}
	for _, l := range o.loads {
		b.addLoad(l)
	}
}

// loadKind is what a load mark stands for.
type loadKind struct {
	layer    int
	prefetch bool
	failed   bool
}

// load marks the finished loads of one kind in a time span: when the first
// finished, and how many there were.
type load struct {
	loadKind
	t int64
	n int
}

// history is what memviz keeps of a snapshot's events as they stream past:
// the charged bytes by category and the finished loads, in at most
// maxBuckets time spans. When the events run past the last span, the spans
// double in width and merge in pairs, so the memory it takes is bounded by
// the drawing's width and the number of layers, not by the number of
// events.
type history struct {
	events     int64
	tmax       int64
	cur        levels // charged now
	total      int64  // sum of cur
	peak       int64  // largest total
	maxBuckets int64
	width      int64 // of a span, in nanoseconds
	buckets    []bucket
	maxLayer   int
}

func newHistory(cols int) *history {
	h := &history{maxBuckets: int64(max(cols, 1)) * 4, width: 1}
	h.sample(0) // the device starts empty
	return h
}

// add takes the next event (paging.ScanSnapshot has checked it alone).
func (h *history) add(ev paging.Event) error {
	n := h.events
	h.events++
	h.tmax = ev.TimeNS
	for ev.TimeNS/h.width >= h.maxBuckets {
		h.coarsen()
	}
	if ev.Kind == paging.EventLoadEnd {
		h.at(ev.TimeNS).addLoad(load{loadKind{ev.Layer, ev.Prefetch, ev.Error != ""}, ev.TimeNS, 1})
		h.maxLayer = max(h.maxLayer, ev.Layer)
	}
	if ev.Charged == 0 {
		return nil
	}
	c, err := paging.ParseCategory(ev.Category)
	if err != nil || int(c) >= len(categories) {
		return fmt.Errorf("event %d: category %q has no colour in memviz", n, ev.Category)
	}
	switch {
	case ev.Charged > 0 && h.total > maxCharged-ev.Charged:
		return fmt.Errorf("event %d: more than 2^62 bytes charged at once", n)
	case h.cur[c]+ev.Charged < 0:
		return fmt.Errorf("event %d: %s returns %s of %s, but only %s is charged: the history does not start from an empty device",
			n, ev.Kind, paging.FormatSize(-ev.Charged), ev.Category, paging.FormatSize(h.cur[c]))
	}
	h.cur[c] += ev.Charged
	h.total += ev.Charged
	h.peak = max(h.peak, h.total)
	h.sample(ev.TimeNS)
	return nil
}

// sample records the charged bytes from time t on.
func (h *history) sample(t int64) {
	h.at(t).add(sample{t: t, cats: h.cur})
}

// at returns the bucket of time t, which is no earlier than any before.
func (h *history) at(t int64) *bucket {
	idx := t / h.width
	if n := len(h.buckets); n == 0 || h.buckets[n-1].idx != idx {
		h.buckets = append(h.buckets, bucket{idx: idx})
	}
	return &h.buckets[len(h.buckets)-1]
}

// coarsen doubles the width of the spans, merging them in pairs.
func (h *history) coarsen() {
	h.width *= 2
	out := h.buckets[:0]
	for _, b := range h.buckets {
		b.idx /= 2
		if n := len(out); n > 0 && out[n-1].idx == b.idx {
			out[n-1].merge(&b)
			continue
		}
		out = append(out, b)
	}
	clear(h.buckets[len(out):]) // drop the merged buckets' loads
	h.buckets = out
}

// samples returns the kept samples in time order.
func (h *history) samples() []sample {
	var s []sample
	for _, b := range h.buckets {
		s = append(s, b.s[:b.n]...)
	}
	return s
}

// readSnapshot reads the snapshot at path into a history sized for a plot
// of cols pixel columns, stopping when ctx is cancelled. It reads only
// regular files: a directory, a pipe or a device is refused before it is
// opened.
func readSnapshot(ctx context.Context, path string, cols int) (*paging.Snapshot, *history, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, nil, fmt.Errorf("%s: is %s, not a snapshot file", path, fileKind(fi.Mode()))
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	snap, h, err := readHistory(infile.Reader(ctx, f), cols)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	return snap, h, nil
}

// readHistory streams a snapshot's events into a history.
func readHistory(r io.Reader, cols int) (*paging.Snapshot, *history, error) {
	h := newHistory(cols)
	snap, err := paging.ScanSnapshot(r, h.add)
	if err != nil {
		return nil, nil, err
	}
	return snap, h, nil
}

func fileKind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeDevice != 0:
		return "a device"
	}
	return "a special file"
}
