package paging

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"time"
)

// Kinds of Event.
const (
	EventAlloc     = "alloc"      // a tensor was allocated
	EventFree      = "free"       // a tensor was freed
	EventReserve   = "reserve"    // bytes were charged with no tensor behind them (unified memory, the device's fixed workspace)
	EventUnreserve = "unreserve"  // a reservation was returned
	EventLoadStart = "load_start" // a layer load began (demand or prefetch)
	EventLoadEnd   = "load_end"   // a layer load finished; Bytes were uploaded
	EventEvict     = "evict"      // a layer part left the device
	EventHit       = "hit"        // Acquire found the layer on the device
	EventMiss      = "miss"       // Acquire had to wait for a load
	EventCache     = "cache"      // Bytes entered (Charged > 0) or left the backend's cache of freed blocks
)

// Event is one entry of a Budget's history. Charged is the change, in bytes,
// of what is counted against the budget; summing it per category over time
// gives the device's memory by category.
type Event struct {
	TimeNS   int64  `json:"t_ns"` // since the history started
	Kind     string `json:"kind"`
	Device   string `json:"device"`
	Category string `json:"category,omitempty"`
	Layer    int    `json:"layer"` // -1 when not about a layer
	Pager    int    `json:"pager,omitempty"`
	Bytes    int64  `json:"bytes,omitempty"`
	Charged  int64  `json:"charged,omitempty"`
	Prefetch bool   `json:"prefetch,omitempty"`
	Error    string `json:"error,omitempty"`
}

// Snapshot is what WriteSnapshot writes: the budget's accounts, every
// recorded event and the statistics of each pager.
type Snapshot struct {
	Device     string          `json:"device"`
	Limit      int64           `json:"limit_bytes"`
	Used       int64           `json:"used_bytes"`
	Peak       int64           `json:"peak_bytes"`
	Start      time.Time       `json:"start"`
	Categories []CategoryStats `json:"categories"`
	Pagers     []Stats         `json:"pagers,omitempty"`
	// Closed says whether the budget was closed when the snapshot was
	// taken. Bytes still charged in a closed budget were leaked; in an open
	// one they are expected (the model is still loaded). Nil in snapshots
	// written before the field existed: they do not say.
	Closed        *bool   `json:"closed,omitempty"`
	Events        []Event `json:"events"`
	DroppedEvents int64   `json:"dropped_events,omitempty"`
}

type recorder struct {
	start   time.Time
	max     int
	events  []Event
	dropped int64
}

// RecordHistory starts recording every allocation, free and paging event,
// keeping at most maxEvents (later ones are counted as dropped). Call it
// before allocating: the history starts with what NewBudget charged (the
// device's fixed workspace, the backend's cache), one reserve event per
// category, so that its charges add up to the budget's.
func (bg *Budget) RecordHistory(maxEvents int) {
	bg.mu.Lock()
	defer bg.mu.Unlock()
	if bg.rec == nil {
		bg.rec = &recorder{start: time.Now(), max: maxEvents}
		for c, cs := range bg.cats {
			if cs.Reserved != 0 {
				bg.recordLocked(Event{Kind: EventReserve, Category: Category(c).String(), Layer: -1, Bytes: cs.Reserved, Charged: cs.Reserved})
			}
		}
	}
	bg.rec.max = maxEvents
}

func (bg *Budget) record(ev Event) {
	bg.mu.Lock()
	bg.recordLocked(ev)
	bg.mu.Unlock()
}

func (bg *Budget) recordLocked(ev Event) {
	r := bg.rec
	if r == nil {
		return
	}
	if len(r.events) >= r.max {
		r.dropped++
		return
	}
	ev.TimeNS = time.Since(r.start).Nanoseconds()
	ev.Device = bg.device
	r.events = append(r.events, ev)
}

// Snapshot returns the budget's accounts and recorded history (empty unless
// RecordHistory was called).
func (bg *Budget) Snapshot() *Snapshot {
	var stats []Stats
	for _, e := range bg.registered() {
		if s, ok := e.(interface{ Stats() Stats }); ok {
			stats = append(stats, s.Stats())
		}
	}
	bg.mu.Lock()
	defer bg.mu.Unlock()
	s := &Snapshot{
		Device:     bg.device,
		Limit:      bg.limit,
		Used:       bg.used,
		Peak:       bg.peak,
		Categories: append([]CategoryStats(nil), bg.cats[:]...),
		Pagers:     stats,
		Closed:     new(bg.closed),
		Events:     []Event{},
	}
	if bg.rec != nil {
		s.Start = bg.rec.start
		s.Events = append(s.Events, bg.rec.events...)
		s.DroppedEvents = bg.rec.dropped
	}
	return s
}

// WriteSnapshot writes Snapshot as JSON; examples/memviz draws it.
func (bg *Budget) WriteSnapshot(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", " ")
	if err := enc.Encode(bg.Snapshot()); err != nil {
		return fmt.Errorf("paging: writing snapshot of %s: %w", bg.device, err)
	}
	return nil
}

// maxSnapshotBytes bounds every byte count of a snapshot, as tensorBytes
// bounds an allocation: sums of a few of them cannot overflow an int64.
const maxSnapshotBytes = 1 << 62

// ReadSnapshot reads what WriteSnapshot wrote, every event in memory. To
// read a large snapshot, use ScanSnapshot.
func ReadSnapshot(r io.Reader) (*Snapshot, error) {
	var evs []Event
	s, err := ScanSnapshot(r, func(ev Event) error {
		evs = append(evs, ev)
		return nil
	})
	if err != nil {
		return nil, err
	}
	s.Events = evs
	if s.Events == nil {
		s.Events = []Event{} // as Snapshot has them
	}
	return s, nil
}

// ScanSnapshot reads what WriteSnapshot wrote, handing each event to fn in
// order instead of keeping it: the Snapshot it returns has no Events, and
// the memory it takes does not grow with the number of events. An error
// from fn stops the scan and is returned as is.
//
// It checks what any reader relies on: the fields have their types, byte
// counts are not negative, kinds and categories are ones this package
// writes, a charge has the sign of its kind and is no larger than its
// bytes, and time never goes backwards. Its errors fit on one line.
func ScanSnapshot(r io.Reader, fn func(Event) error) (*Snapshot, error) {
	var fnErr error
	s, err := scanSnapshot(json.NewDecoder(r), func(ev Event) error {
		fnErr = fn(ev)
		return fnErr
	})
	switch {
	case fnErr != nil:
		return nil, fnErr
	case err != nil:
		return nil, fmt.Errorf("paging: reading snapshot: %w", err)
	}
	return s, nil
}

func scanSnapshot(dec *json.Decoder, fn func(Event) error) (*Snapshot, error) {
	if err := expectDelim(dec, '{', "an object"); err != nil {
		return nil, err
	}
	var s Snapshot
	fields := map[string]any{
		"device":         &s.Device,
		"limit_bytes":    &s.Limit,
		"used_bytes":     &s.Used,
		"peak_bytes":     &s.Peak,
		"start":          &s.Start,
		"categories":     &s.Categories,
		"pagers":         &s.Pagers,
		"closed":         &s.Closed,
		"dropped_events": &s.DroppedEvents,
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, jsonError(dec, err)
		}
		key, _ := tok.(string)
		if seen[key] {
			return nil, fmt.Errorf("field %q appears twice", key)
		}
		seen[key] = true
		if key == "events" {
			if err := scanEvents(dec, fn); err != nil {
				return nil, err
			}
			continue
		}
		dst, ok := fields[key]
		if !ok {
			dst = new(json.RawMessage) // a field of a later version
		}
		if err := dec.Decode(dst); err != nil {
			return nil, fmt.Errorf("field %q: %w", key, jsonError(dec, err))
		}
	}
	if err := expectDelim(dec, '}', "the end of the object"); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("more data after the snapshot at byte %d", dec.InputOffset())
	}
	for _, k := range []string{"device", "limit_bytes", "peak_bytes", "events"} {
		if !seen[k] {
			return nil, fmt.Errorf("no %q field", k)
		}
	}
	for _, f := range []struct {
		name     string
		v, limit int64
	}{
		{"limit_bytes", s.Limit, math.MaxInt64},
		{"used_bytes", s.Used, maxSnapshotBytes},
		{"peak_bytes", s.Peak, maxSnapshotBytes},
		{"dropped_events", s.DroppedEvents, math.MaxInt64},
	} {
		if f.v < 0 || f.v > f.limit {
			return nil, fmt.Errorf("%s of %d", f.name, f.v)
		}
	}
	for _, c := range s.Categories {
		if _, ok := categoryNamed(c.Category); !ok {
			return nil, fmt.Errorf("categories: unknown category %q", c.Category)
		}
		for _, v := range []int64{c.Allocated, c.PeakAllocated, c.Reserved, c.PeakReserved, c.Allocs, c.Frees, c.Leaked} {
			if v < 0 || v > maxSnapshotBytes {
				return nil, fmt.Errorf("categories: %s: a count of %d", c.Category, v)
			}
		}
	}
	return &s, nil
}

// scanEvents reads the events array, checking each event and handing it
// to fn.
func scanEvents(dec *json.Decoder, fn func(Event) error) error {
	if err := expectDelim(dec, '[', "an array of events"); err != nil {
		return fmt.Errorf("field \"events\": %w", err)
	}
	var prev int64
	var ev Event // one for all: a variable per event would escape, one allocation each
	for i := 0; dec.More(); i++ {
		at := dec.InputOffset()
		ev = Event{}
		if err := dec.Decode(&ev); err != nil {
			return fmt.Errorf("event %d: %w", i, jsonError(dec, err))
		}
		if err := checkEvent(ev, prev); err != nil {
			return fmt.Errorf("event %d at byte %d: %w", i, at, err)
		}
		prev = ev.TimeNS
		if err := fn(ev); err != nil {
			return err
		}
	}
	return expectDelim(dec, ']', "the end of the events")
}

// eventSign is the sign a kind's charge may have: 1 adds bytes, -1 returns
// them, 0 charges nothing, 2 either.
var eventSign = map[string]int{
	EventAlloc: 1, EventReserve: 1, EventFree: -1, EventUnreserve: -1, EventCache: 2,
	EventLoadStart: 0, EventLoadEnd: 0, EventEvict: 0, EventHit: 0, EventMiss: 0,
}

func checkEvent(ev Event, prev int64) error {
	sign, ok := eventSign[ev.Kind]
	switch {
	case !ok:
		return fmt.Errorf("unknown kind %q", ev.Kind)
	case ev.TimeNS < 0:
		return fmt.Errorf("negative time %d ns", ev.TimeNS)
	case ev.TimeNS < prev:
		return fmt.Errorf("time goes backwards, from %d ns to %d ns", prev, ev.TimeNS)
	case ev.Bytes < 0 || ev.Bytes > maxSnapshotBytes:
		return fmt.Errorf("%s of %d bytes", ev.Kind, ev.Bytes)
	case ev.Layer < -1:
		return fmt.Errorf("layer %d", ev.Layer)
	case ev.Pager < 0:
		return fmt.Errorf("pager %d", ev.Pager)
	}
	if _, ok := categoryNamed(ev.Category); !ok && (sign != 0 || ev.Category != "") {
		return fmt.Errorf("%s: unknown category %q", ev.Kind, ev.Category)
	}
	if (sign == 0 && ev.Charged != 0) || (sign == 1 && (ev.Charged < 0 || ev.Charged > ev.Bytes)) || (sign < 0 && (ev.Charged > 0 || ev.Charged < -ev.Bytes)) ||
		(sign == 2 && (ev.Charged > ev.Bytes || ev.Charged < -ev.Bytes)) {
		return fmt.Errorf("%s of %d bytes charges %d", ev.Kind, ev.Bytes, ev.Charged)
	}
	return nil
}

func expectDelim(dec *json.Decoder, want json.Delim, what string) error {
	tok, err := dec.Token()
	if err == io.EOF && want == '{' {
		return errors.New("empty input")
	}
	if err != nil {
		return jsonError(dec, err)
	}
	if d, ok := tok.(json.Delim); !ok || d != want {
		return fmt.Errorf("want %s at byte %d, found %v", what, dec.InputOffset(), tok)
	}
	return nil
}

// jsonError says where the decoder stopped; a truncated file says so.
func jsonError(dec *json.Decoder, err error) error {
	if err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("truncated at byte %d", dec.InputOffset())
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return fmt.Errorf("invalid JSON at byte %d: %v", se.Offset, se)
	}
	return err
}
