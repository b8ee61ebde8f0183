//go:build cuda

package cuda

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"os"
	"sync/atomic"
	"time"

	"github.com/strata-llm/strata/internal/atomicfile"
	"gorgonia.org/cu"
)

// TimelineEnv names the environment variable that makes a backend keep a
// timeline of its copies: each UploadAsync copy (when it was queued, when
// the copy engine ran it), each wait of the compute stream for one, and
// each download (when the host asked, when the device copied, when the
// host had it). The backend writes it, as tab-separated values, to the
// file the variable names when it closes (a second backend of the process
// writes the name with .1, .2 ... added). It is a measuring tool, for
// finding where a link idles: what the device and the host did between
// two copies. Times are nanoseconds from the backend's start, the device's
// from an event recorded then, the host's set to agree with it to within
// the few microseconds an idle stream takes to reach a queued event
// (startTimeline).
const TimelineEnv = "STRATA_CUDA_TIMELINE"

// timelineProbes is the events startTimeline sets the host's clock from.
const timelineProbes = 8

// timelineMax bounds the records a backend keeps (the first ones).
const timelineMax = 1 << 20

// timelines counts the backends of the process that kept a timeline, for
// the files' names.
var timelines atomic.Int32

// timeline is a backend's record of its copies, when TimelineEnv is set.
type timeline struct {
	path  string
	base  cu.Event  // recorded on the compute stream at the start
	host0 time.Time // the host's time then
	recs  []tlRecord
}

// tlRecord is one copy, wait or download.
type tlRecord struct {
	kind                 string // h2d, stall (the compute stream waiting for a copy), d2h, mark:LABEL
	bytes                int64
	host, hostEnd        time.Duration // queued; for d2h, when the host had the bytes
	devStart, devEnd     time.Duration
	devKnown, hostEndSet bool
}

// startTimeline begins the timeline when TimelineEnv is set; the context
// is current and the streams exist.
func (b *Backend) startTimeline() error {
	path := os.Getenv(TimelineEnv)
	if path == "" {
		return nil
	}
	if n := timelines.Add(1); n > 1 {
		path = fmt.Sprintf("%s.%d", path, n-1)
	}
	ev, err := cu.MakeEvent(cu.DefaultEvent)
	if err != nil {
		return fmt.Errorf("%s: the timeline's event: %w", b.name, cuError(err))
	}
	b.evAll = append(b.evAll, ev)
	if err := b.compute.Synchronize(); err != nil {
		return fmt.Errorf("%s: the timeline's event: %w", b.name, cuError(err))
	}
	host0 := time.Now()
	if err := ev.Record(b.compute); err != nil {
		return fmt.Errorf("%s: the timeline's event: %w", b.name, cuError(err))
	}
	if err := ev.Synchronize(); err != nil {
		return fmt.Errorf("%s: the timeline's event: %w", b.name, cuError(err))
	}
	// Neither the time the base event was queued at nor the wake-up from
	// the wait for it is the device's zero (the first ran 87 us ahead of
	// it on the H200, the second 140-250 us behind). The host's clock is
	// set from probes instead: an event queued on the idle stream at host
	// time q is reached at device time d >= q+c, c the clocks' offset, so
	// the least d-q over a few probes is c plus the shortest reach, a few
	// microseconds.
	probe, err := cu.MakeEvent(cu.DefaultEvent)
	if err != nil {
		return fmt.Errorf("%s: the timeline's probe: %w", b.name, cuError(err))
	}
	defer cu.DestroyEvent(&probe)
	off := time.Duration(math.MaxInt64)
	for range timelineProbes {
		q := time.Since(host0)
		if err := probe.Record(b.compute); err != nil {
			return fmt.Errorf("%s: the timeline's probe: %w", b.name, cuError(err))
		}
		if err := probe.Synchronize(); err != nil {
			return fmt.Errorf("%s: the timeline's probe: %w", b.name, cuError(err))
		}
		ms, err := ev.Elapsed(probe)
		if err != nil {
			return fmt.Errorf("%s: the timeline's probe: %w", b.name, cuError(err))
		}
		off = min(off, time.Duration(ms*float64(time.Millisecond))-q)
	}
	host0 = host0.Add(-off)
	b.tl = &timeline{path: path, base: ev, host0: host0}
	return nil
}

// tlNow is the host's time on the timeline; zero without one.
func (b *Backend) tlNow() time.Duration {
	if b.tl == nil {
		return 0
	}
	return time.Since(b.tl.host0)
}

// Mark adds the host's time now to the timeline as a record of kind
// mark:label, with no bytes nor device times (tensor.Marker): where the
// host's work between two copies goes. Without a timeline it does nothing.
func (b *Backend) Mark(label string) {
	if b.tl == nil {
		return
	}
	host := b.tlNow()
	b.evMu.Lock()
	defer b.evMu.Unlock()
	b.tlAddLocked(tlRecord{kind: "mark:" + label, host: host}, nil)
}

// tlAddLocked adds r to the timeline, unless it holds timelineMax
// records; with ends (a span's start and end events, reached), r gets their
// device times. The caller holds evMu.
func (b *Backend) tlAddLocked(r tlRecord, ends *[2]cu.Event) {
	if len(b.tl.recs) >= timelineMax {
		return
	}
	if ends != nil {
		s, ok1 := b.tlDevice(ends[0])
		e, ok2 := b.tlDevice(ends[1])
		r.devStart, r.devEnd, r.devKnown = s, e, ok1 && ok2
	}
	b.tl.recs = append(b.tl.recs, r)
}

// tlDevice returns the device's time of a reached event on the timeline.
func (b *Backend) tlDevice(ev cu.Event) (time.Duration, bool) {
	ms, err := b.tl.base.Elapsed(ev)
	if err != nil {
		return 0, false
	}
	return time.Duration(ms * float64(time.Millisecond)), true
}

// tlSpanLocked adds a span whose end has been reached; the caller holds
// evMu.
func (b *Backend) tlSpanLocked(sp span) {
	if b.tl == nil {
		return
	}
	r := tlRecord{kind: "h2d", bytes: sp.bytes, host: sp.host}
	if sp.stall {
		r.kind = "stall"
	}
	b.tlAddLocked(r, &[2]cu.Event{sp.start, sp.end})
}

// tlDownload starts the timing of a download on the compute stream: it
// records an event before the copy and returns the function that records
// one after it, and the one that adds the record once the host has the
// bytes. Without a timeline both do nothing.
func (b *Backend) tlDownload(bytes int64) (after func(), done func()) {
	nop := func() {}
	if b.tl == nil {
		return nop, nop
	}
	host := b.tlNow()
	start, end, ok := b.timedPair()
	if !ok {
		return nop, nop
	}
	recorded := start.Record(b.compute) == nil
	after = func() { recorded = recorded && end.Record(b.compute) == nil }
	done = func() {
		b.evMu.Lock()
		defer b.evMu.Unlock()
		if recorded {
			b.tlAddLocked(tlRecord{kind: "d2h", bytes: bytes, host: host, hostEnd: b.tlNow(), hostEndSet: true}, &[2]cu.Event{start, end})
		}
		b.tevFree = append(b.tevFree, start, end)
	}
	return after, done
}

// writeTimeline writes the timeline (streams synchronised, spans drained);
// the caller holds evMu.
func (b *Backend) writeTimelineLocked() error {
	if b.tl == nil {
		return nil
	}
	return atomicfile.Write(b.tl.path, func(w io.Writer) error {
		bw := bufio.NewWriter(w)
		fmt.Fprintln(bw, "kind\tbytes\thost_ns\thost_end_ns\tdev_start_ns\tdev_end_ns")
		for _, r := range b.tl.recs {
			he, ds, de := "-", "-", "-"
			if r.hostEndSet {
				he = fmt.Sprint(int64(r.hostEnd))
			}
			if r.devKnown {
				ds, de = fmt.Sprint(int64(r.devStart)), fmt.Sprint(int64(r.devEnd))
			}
			fmt.Fprintf(bw, "%s\t%d\t%d\t%s\t%s\t%s\n", r.kind, r.bytes, int64(r.host), he, ds, de)
		}
		return bw.Flush()
	})
}
