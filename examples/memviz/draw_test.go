package main

import (
	"encoding/xml"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// element is one SVG element of a drawing, with its attributes and text.
type element struct {
	name string
	attr map[string]string
	text string
}

// draw runs memviz on snap and returns the drawing's elements.
func draw(t *testing.T, snap *paging.Snapshot) (string, []element) {
	t.Helper()
	dir := t.TempDir()
	out := filepath.Join(dir, "mem.svg")
	if err := run([]string{writeSnapshot(t, dir, snap), "-o", out}, io.Discard); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return string(data), elements(t, string(data))
}

func elements(t *testing.T, svg string) []element {
	t.Helper()
	var els []element
	dec := xml.NewDecoder(strings.NewReader(svg))
	var open []int // indexes of the elements being read
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			return els
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v", err)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			e := element{name: tok.Name.Local, attr: map[string]string{}}
			for _, a := range tok.Attr {
				e.attr[a.Name.Local] = a.Value
			}
			open = append(open, len(els))
			els = append(els, e)
		case xml.CharData:
			if len(open) > 0 {
				els[open[len(open)-1]].text += string(tok)
			}
		case xml.EndElement:
			open = open[:len(open)-1]
		}
	}
}

type point struct{ x, y float64 }

func points(t *testing.T, s string) []point {
	t.Helper()
	var ps []point
	for _, f := range strings.Fields(s) {
		xs, ys, ok := strings.Cut(f, ",")
		x, err1 := strconv.ParseFloat(xs, 64)
		y, err2 := strconv.ParseFloat(ys, 64)
		if !ok || err1 != nil || err2 != nil {
			t.Fatalf("bad point %q", f)
		}
		ps = append(ps, point{x, y})
	}
	return ps
}

// longSnapshot has n events over a second: enough to be thinned to the
// drawing's columns, with allocations of every size coming and going.
func longSnapshot(n int) *paging.Snapshot {
	cats := []string{paging.ResidentWeights.String(), paging.KVCache.String(), paging.Activations.String(), paging.Workspace.String()}
	var evs []paging.Event
	live := map[string]int64{}
	for i := range n {
		cat := cats[i*7%len(cats)]
		size := int64(1+i*13%97) << 10
		ev := paging.Event{TimeNS: int64(i) * 1e9 / int64(n), Kind: paging.EventAlloc, Device: "fake:0", Category: cat, Layer: -1, Bytes: size, Charged: size}
		if live[cat] >= size && i%3 != 0 {
			ev.Kind, ev.Charged = paging.EventFree, -size
		}
		live[cat] += ev.Charged
		evs = append(evs, ev)
	}
	return &paging.Snapshot{Device: "fake:0", Limit: 1 << 30, Peak: 0, Events: evs, Closed: new(false)}
}

// TestStepFunction: every band is a step function of time: its outline
// has only horizontal and vertical edges, and it runs to the end of the
// chart.
func TestStepFunction(t *testing.T) {
	for _, tc := range []struct {
		name string
		snap *paging.Snapshot
	}{
		{"small", testSnapshot()},
		{"recorded", recordedSnapshot(t, budgetOpen)},
		{"thinned", longSnapshot(50000)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, els := draw(t, tc.snap)
			right := float64(marginLeft + plotWidth(1100))
			bands := 0
			for _, e := range els {
				if e.name != "polygon" {
					continue
				}
				bands++
				ps := points(t, e.attr["points"])
				if len(ps) < 4 {
					t.Fatalf("%s: %d points", e.attr["data-category"], len(ps))
				}
				maxX := 0.0
				for i, p := range ps {
					q := ps[(i+1)%len(ps)]
					if p.x != q.x && p.y != q.y {
						t.Fatalf("%s: edge %d from %v to %v is neither horizontal nor vertical", e.attr["data-category"], i, p, q)
					}
					maxX = max(maxX, p.x)
				}
				if maxX != right {
					t.Errorf("%s: ends at x=%v, the chart at %v", e.attr["data-category"], maxX, right)
				}
			}
			if bands < 2 {
				t.Errorf("%d bands", bands)
			}
		})
	}
}

// TestScale: the byte axis covers the data, not a budget far above it; its
// labels are never negative; the budget line is drawn only when it is near
// the peak, and the legend says where it is otherwise.
func TestScale(t *testing.T) {
	const peak = 548 << 10
	for _, tc := range []struct {
		name      string
		limit     int64
		wantLimit bool   // the budget line is drawn
		note      string // the legend's note when it is not
	}{
		{"no budget", math.MaxInt64 / 4, false, "no budget"},
		{"largest limit", math.MaxInt64, false, "no budget"},
		{"device memory", 80 << 30, false, "budget 80.00 GiB, off the chart"},
		{"near", peak * 3 / 2, true, ""},
		{"at peak", peak, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			snap := &paging.Snapshot{Device: "cpu", Limit: tc.limit, Peak: peak, Used: peak, Closed: new(false), Events: []paging.Event{
				{TimeNS: 10, Kind: paging.EventAlloc, Category: paging.ResidentWeights.String(), Layer: 0, Bytes: peak - 1000, Charged: peak - 1000},
				{TimeNS: 20, Kind: paging.EventAlloc, Category: paging.Activations.String(), Layer: -1, Bytes: 1000, Charged: 1000},
				{TimeNS: 30, Kind: paging.EventFree, Category: paging.Activations.String(), Layer: -1, Bytes: 1000, Charged: -1000},
			}}
			_, els := draw(t, snap)
			var top int64 = -1
			limits, notes := 0, ""
			for _, e := range els {
				switch {
				case e.attr["class"] == "ytick":
					b, err := strconv.ParseInt(e.attr["data-bytes"], 10, 64)
					if err != nil || b < 0 || b <= top || strings.HasPrefix(e.text, "-") {
						t.Errorf("tick %q at %q after %d", e.text, e.attr["data-bytes"], top)
					}
					top = b
				case e.attr["class"] == "limit":
					limits++
				case e.attr["class"] == "budget-note":
					notes = e.text
				}
			}
			hi := int64(peak)
			if tc.wantLimit {
				hi = max(hi, tc.limit)
			}
			if top < hi || top > 2*hi {
				t.Errorf("axis up to %d bytes for data up to %d", top, hi)
			}
			if (limits == 1) != tc.wantLimit || notes != tc.note {
				t.Errorf("%d budget lines, note %q; want line %v, note %q", limits, notes, tc.wantLimit, tc.note)
			}
		})
	}
}

type budgetEnd int

const (
	budgetOpen   budgetEnd = iota // snapshot taken with the model loaded
	budgetClosed                  // everything freed, then closed
	budgetLeaked                  // the KV cache never freed, then closed
)

// recordedSnapshot records a budget on the CPU backend: a KV cache, and
// activations allocated and freed.
func recordedSnapshot(t *testing.T, end budgetEnd) *paging.Snapshot {
	t.Helper()
	cpu := tensor.NewCPU(1)
	t.Cleanup(func() { cpu.Close() })
	bg, err := paging.NewBudget(cpu, 1<<20, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	bg.RecordHistory(1 << 10)
	kv, err := bg.Alloc(paging.KVCache, tensor.F32, tensor.Shape{4096})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		act, err := bg.Alloc(paging.Activations, tensor.F32, tensor.Shape{8192})
		if err != nil {
			t.Fatal(err)
		}
		bg.Free(act)
	}
	switch end {
	case budgetClosed:
		bg.Free(kv)
		if err := bg.Close(); err != nil {
			t.Fatal(err)
		}
	case budgetLeaked:
		if err := bg.Close(); !errors.Is(err, paging.ErrLeak) {
			t.Fatalf("Close: %v, want a leak", err)
		}
	default:
		t.Cleanup(func() { bg.Free(kv); bg.Close() })
	}
	return bg.Snapshot()
}

// TestEndNote: bytes left at the end are called a leak only when the
// budget was closed; a snapshot of an open budget, or of an older format
// that does not say, gets a note instead.
func TestEndNote(t *testing.T) {
	old := longSnapshot(100)
	old.Closed = nil
	closedLeft := longSnapshot(100)
	closedLeft.Closed = new(true)
	dropped := longSnapshot(100)
	dropped.Closed, dropped.DroppedEvents = new(true), 5
	for _, tc := range []struct {
		name string
		snap *paging.Snapshot
		want string // class of the note: leak, note or none
		text string
	}{
		{"open model", recordedSnapshot(t, budgetOpen), "note", "16.00 KiB still charged: the snapshot was taken with the budget open"},
		{"closed clean", recordedSnapshot(t, budgetClosed), "", ""},
		{"closed with a leak", recordedSnapshot(t, budgetLeaked), "leak", "found 16.00 KiB still allocated (16.00 KiB kv cache)"},
		{"older format", old, "note", "does not say whether the budget was closed"},
		{"charged after close", closedLeft, "leak", "still charged after the budget was closed"},
		{"history cut short", dropped, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, els := draw(t, tc.snap)
			var class, text string
			for _, e := range els {
				if c := e.attr["class"]; c == "leak" || c == "note" {
					if class != "" {
						t.Errorf("two notes: %q and %q", text, e.text)
					}
					class, text = c, e.text
				}
			}
			if class != tc.want || !strings.Contains(text, tc.text) {
				t.Errorf("note %s %q, want %s %q", class, text, tc.want, tc.text)
			}
		})
	}
}

// TestCategoriesHaveColours: every category paging writes has its band.
func TestCategoriesHaveColours(t *testing.T) {
	n := 0
	for c := paging.Category(0); ; c++ {
		if _, err := paging.ParseCategory(c.String()); err != nil {
			break
		}
		if int(c) >= len(categories) || categories[c].name != c.String() {
			t.Errorf("category %d (%s) has no colour", c, c)
		}
		n++
	}
	if n != len(categories) {
		t.Errorf("%d categories in paging, %d colours", n, len(categories))
	}
}

func TestAxis(t *testing.T) {
	for _, hi := range []int64{0, 1, 4, 999, 1 << 10, 300000, 315000, 5 << 20, 3 << 30, 80 << 30, 1 << 62} {
		top, step, unit := axis(hi)
		if top < hi || step <= 0 || top%step != 0 || top/step > 5 || float64(top) > 1.5*float64(max(hi, 1))+1 {
			t.Errorf("axis(%d) = %d in steps of %d", hi, top, step)
		}
		if l := tickLabel(step, unit); strings.Contains(l, "e") || strings.HasPrefix(l, "-") {
			t.Errorf("axis(%d): label %q", hi, l)
		}
	}
	if top, step, unit := axis(3<<30 + 1); top != 4<<30 || step != 1<<30 || unit != "GiB" || tickLabel(top, unit) != "4 GiB" {
		t.Errorf("axis(3 GiB + 1) = %d in steps of %d %s", top, step, unit)
	}
}
