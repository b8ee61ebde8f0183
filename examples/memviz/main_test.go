package main

import (
	"context"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// history: a ring reserved, two layers loaded and evicted in turn, a KV
// cache allocated and never freed, in a budget said to be closed (a leak).
func testSnapshot() *paging.Snapshot {
	ev := func(t int64, kind, cat string, layer int, bytes, charged int64, prefetch bool) paging.Event {
		return paging.Event{TimeNS: t, Kind: kind, Device: "fake:0", Category: cat, Layer: layer, Bytes: bytes, Charged: charged, Prefetch: prefetch}
	}
	res, str, kv := paging.ResidentWeights.String(), paging.StreamedWeights.String(), paging.KVCache.String()
	var evs []paging.Event
	evs = append(evs, ev(0, paging.EventReserve, str, -1, 400, 400, false))
	evs = append(evs, ev(10, paging.EventAlloc, kv, -1, 300, 300, false))
	t := int64(20)
	for tok := 0; tok < 50; tok++ {
		for l := 0; l < 3; l++ {
			evs = append(evs, ev(t, paging.EventLoadStart, "", l, 0, 0, l > 0))
			if tok == 0 && l == 0 {
				evs = append(evs, ev(t+1, paging.EventAlloc, res, l, 200, 200, false))
			}
			evs = append(evs, ev(t+2, paging.EventAlloc, str, l, 350, 0, false))
			evs = append(evs, ev(t+3, paging.EventLoadEnd, "", l, 350, 0, l > 0))
			evs = append(evs, ev(t+5, paging.EventFree, str, l, 350, 0, false))
			t += 10
		}
	}
	evs = append(evs, ev(t, paging.EventFree, res, 0, 200, -200, false))
	evs = append(evs, ev(t+1, paging.EventUnreserve, str, -1, 400, -400, false))
	return &paging.Snapshot{Device: "fake:0", Limit: 1000, Peak: 900, Used: 300, Events: evs, Closed: new(true),
		Categories: []paging.CategoryStats{{Category: kv, Allocated: 300, Reserved: 300, PeakReserved: 300, Allocs: 1}}}
}

func writeSnapshot(t *testing.T, dir string, s *paging.Snapshot) string {
	p := filepath.Join(dir, "snap.json")
	data, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestSVG(t *testing.T) {
	dir := t.TempDir()
	in := writeSnapshot(t, dir, testSnapshot())
	out := filepath.Join(dir, "mem.svg")
	if err := run([]string{in, "-o", out}, io.Discard); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	// well-formed XML, with a polygon per category used and a mark per load
	dec := xml.NewDecoder(strings.NewReader(string(data)))
	polys := map[string]bool{}
	loads, limits := 0, 0
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v", err)
		}
		se, ok := tok.(xml.StartElement)
		if !ok {
			continue
		}
		attr := map[string]string{}
		for _, a := range se.Attr {
			attr[a.Name.Local] = a.Value
		}
		switch {
		case se.Name.Local == "polygon":
			polys[attr["data-category"]] = true
		case se.Name.Local == "circle" && attr["class"] == "load":
			loads++
		case se.Name.Local == "line" && attr["class"] == "limit":
			limits++
		}
	}
	for _, c := range []string{"resident weights", "streamed weights", "kv cache"} {
		if !polys[c] {
			t.Errorf("no area for %s (have %v)", c, polys)
		}
	}
	if polys["activations"] {
		t.Error("an area for a category never used")
	}
	if loads != 150 || limits != 1 {
		t.Errorf("%d load marks (want 150), %d budget lines", loads, limits)
	}
	if !strings.Contains(string(data), `class="leak"`) {
		t.Error("the KV cache never freed is not flagged")
	}
}

func TestHTMLAndDefaults(t *testing.T) {
	dir := t.TempDir()
	in := writeSnapshot(t, dir, testSnapshot())
	out := filepath.Join(dir, "mem.html")
	if err := run([]string{"-o", out, in}, io.Discard); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(out)
	if !strings.Contains(string(data), "<svg") || !strings.Contains(string(data), "<table>") {
		t.Error("HTML page lacks the drawing or the table")
	}
	if err := run([]string{in}, io.Discard); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "snap.svg")); err != nil {
		t.Errorf("default output: %v", err)
	}
}

func TestBadInput(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte("{not json"), 0o644)
	for _, args := range [][]string{
		{},
		{bad},
		{filepath.Join(dir, "missing.json")},
		{writeSnapshot(t, dir, testSnapshot()), "-o", filepath.Join(dir, "x.png")},
		{"a.json", "b.json"},
	} {
		if err := run(args, io.Discard); err == nil {
			t.Errorf("memviz %v succeeded", args)
		}
	}
}

// memSource is a small in-memory model: layer l has two F16 tensors.
type memSource struct{ layers [][]paging.TensorSpec }

func (m memSource) NumLayers() int                         { return len(m.layers) }
func (m memSource) LayerTensors(l int) []paging.TensorSpec { return m.layers[l] }
func (m memSource) ReadTensor(_ context.Context, l int, name string, dst []byte) error {
	for i := range dst {
		dst[i] = byte(l + i)
	}
	return nil
}

// TestFromPagingSnapshot draws a snapshot recorded by a real pager on the
// CPU backend.
func TestFromPagingSnapshot(t *testing.T) {
	var src memSource
	for l := range 6 {
		var ts []paging.TensorSpec
		for k, rows := range []int{64, 32} {
			s := tensor.Shape{rows + 8*l, 16}
			ts = append(ts, paging.TensorSpec{Name: fmt.Sprintf("l%d.w%d", l, k), DType: tensor.F16, Shape: s, Bytes: s.NumElements() * 2})
		}
		src.layers = append(src.layers, ts)
	}
	layers, err := paging.DescribeSource(src)
	if err != nil {
		t.Fatal(err)
	}
	// A KV cache of 64 bytes a position and block, activations of 1 KiB a
	// token.
	info := paging.ModelInfo{Layers: layers, NumLayers: 4, Reserve: paging.Reserve{
		{Category: paging.KVCache, Bytes: 64, Per: paging.PerPosition, Count: 1, PerBlock: true},
		{Category: paging.Activations, Bytes: 1024, Per: paging.PerToken, Count: 1},
	}}
	var w int64
	for _, l := range layers {
		w += l.Bytes
	}
	kv := info.Reserve.Bytes(paging.KVCache, 4, 16, 16, 1, nil)
	act := info.Reserve.Bytes(paging.Activations, 4, 16, 16, 1, nil)
	budget := kv + act + w*6/10
	plan, err := paging.Plan(info, budget, paging.StrategyMinimal, 16, 1)
	if err != nil {
		t.Fatal(err)
	}
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	bg, err := paging.NewBudget(cpu, budget, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	bg.RecordHistory(1 << 20)
	kvT, err := bg.Alloc(paging.KVCache, tensor.F32, tensor.Shape{int(kv / 4)})
	if err != nil {
		t.Fatal(err)
	}
	pg, err := paging.NewPager(src, bg, plan, paging.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		for l := range src.NumLayers() {
			if _, err := pg.Acquire(context.Background(), l); err != nil {
				t.Fatal(err)
			}
			pg.Release(l)
		}
		pg.MarkStep()
	}
	bg.Free(kvT)
	if err := pg.Close(); err != nil {
		t.Fatal(err)
	}
	if err := bg.Close(); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	in := filepath.Join(dir, "snap.json")
	f, err := os.Create(in)
	if err != nil {
		t.Fatal(err)
	}
	if err := bg.WriteSnapshot(f); err != nil {
		t.Fatal(err)
	}
	f.Close()
	out := filepath.Join(dir, "snap.svg")
	if err := run([]string{in, "-o", out}, io.Discard); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(out)
	svg := string(data)
	if !strings.Contains(svg, `data-category="streamed weights"`) || !strings.Contains(svg, `class="load"`) {
		t.Error("drawing lacks streamed weights or load marks")
	}
	if strings.Contains(svg, `class="leak"`) || strings.Contains(svg, `class="note"`) {
		t.Error("a history that returns to zero has a note on what is left")
	}
}
