package paging

import (
	"encoding/json"
	"fmt"
	"io"
	"time"
)

// Kinds of Event.
const (
	EventAlloc     = "alloc"      // a tensor was allocated
	EventFree      = "free"       // a tensor was freed
	EventReserve   = "reserve"    // bytes were charged with no tensor yet (a streaming ring)
	EventUnreserve = "unreserve"  // a reservation was returned
	EventLoadStart = "load_start" // a layer load began (demand or prefetch)
	EventLoadEnd   = "load_end"   // a layer load finished; Bytes were uploaded
	EventEvict     = "evict"      // a layer part left the device
	EventHit       = "hit"        // Acquire found the layer on the device
	EventMiss      = "miss"       // Acquire had to wait for a load
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
	Device        string          `json:"device"`
	Limit         int64           `json:"limit_bytes"`
	Used          int64           `json:"used_bytes"`
	Peak          int64           `json:"peak_bytes"`
	Start         time.Time       `json:"start"`
	Categories    []CategoryStats `json:"categories"`
	Pagers        []Stats         `json:"pagers,omitempty"`
	Events        []Event         `json:"events"`
	DroppedEvents int64           `json:"dropped_events,omitempty"`
}

type recorder struct {
	start   time.Time
	max     int
	events  []Event
	dropped int64
}

// RecordHistory starts recording every allocation, free and paging event,
// keeping at most maxEvents (later ones are counted as dropped). Call it
// before allocating, so the history starts from an empty device.
func (bg *Budget) RecordHistory(maxEvents int) {
	bg.mu.Lock()
	defer bg.mu.Unlock()
	if bg.rec == nil {
		bg.rec = &recorder{start: time.Now()}
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
	for _, p := range bg.attached() {
		stats = append(stats, p.Stats())
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

// ReadSnapshot reads what WriteSnapshot wrote.
func ReadSnapshot(r io.Reader) (*Snapshot, error) {
	var s Snapshot
	dec := json.NewDecoder(r)
	if err := dec.Decode(&s); err != nil {
		return nil, fmt.Errorf("paging: reading snapshot: %w", err)
	}
	if s.Device == "" && len(s.Events) == 0 && len(s.Categories) == 0 {
		return nil, fmt.Errorf("paging: reading snapshot: no device, categories or events: not a memory snapshot")
	}
	return &s, nil
}
