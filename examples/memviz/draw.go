package main

import (
	"cmp"
	"fmt"
	"html"
	"slices"
	"strconv"
	"strings"

	"github.com/strata-llm/strata/paging"
)

// categories in stacking order, bottom first, with their colours: one per
// paging.Category, in its order.
var categories = [...]struct{ name, color string }{
	{paging.ResidentWeights.String(), "#4e79a7"},
	{paging.StreamedWeights.String(), "#76b7b2"},
	{paging.KVCache.String(), "#f28e2b"},
	{paging.Activations.String(), "#e15759"},
	{paging.Workspace.String(), "#b07aa1"},
	{paging.Gradients.String(), "#59a14f"},
	{paging.Cached.String(), "#bab0ac"},
}

// maxCharged bounds the bytes a drawing's arithmetic handles, so that it
// cannot overflow.
const maxCharged = 1 << 62

// noBudget: a limit this large means none was given (generate records
// math.MaxInt64/4).
const noBudget = 1 << 60

// limitFactor: the budget line is drawn when the budget is at most this
// many times the peak; a larger one would flatten the drawing.
const limitFactor = 2

func budgetText(limit int64) string {
	if limit >= noBudget {
		return "no budget"
	}
	return "budget " + paging.FormatSize(limit)
}

// axis returns the top of the byte axis and its step: at most five steps
// of 1, 2 or 5 times a power of ten of a binary unit, together covering hi.
func axis(hi int64) (top, step int64, unit string) {
	hi = max(hi, 1)
	raw := float64(hi) / 5
	u := 0 // index in byteUnits
	for u+1 < len(byteUnits) && raw >= float64(byteUnits[u+1].n) {
		u++
	}
	r := raw / float64(byteUnits[u].n)
	m := int64(0)
	for _, c := range []int64{1, 2, 5, 10, 20, 50, 100, 200, 500} {
		if float64(c) >= r {
			m = c
			break
		}
	}
	if m == 0 { // between 500 and 1024 units: one of the next unit
		m, u = 1, u+1
	}
	step = m * byteUnits[u].n
	return (hi + step - 1) / step * step, step, byteUnits[u].name
}

var byteUnits = []struct {
	n    int64
	name string
}{{1, "B"}, {paging.KiB, "KiB"}, {paging.MiB, "MiB"}, {paging.GiB, "GiB"}, {paging.TiB, "TiB"}, {paging.TiB << 10, "PiB"}, {paging.TiB << 20, "EiB"}}

// tickLabel writes b in the unit of the axis's step.
func tickLabel(b int64, unit string) string {
	if b == 0 {
		return "0"
	}
	for _, u := range byteUnits {
		if u.name == unit {
			return strconv.FormatFloat(float64(b)/float64(u.n), 'f', -1, 64) + " " + unit
		}
	}
	return strconv.FormatInt(b, 10) + " B"
}

// thin keeps, per pixel column, the sample with the largest total and the
// column's last one, so peaks survive and the drawing stays small.
func thin(s []sample, tmax int64, cols int) []sample {
	if len(s) <= 2*cols {
		return s
	}
	var out []sample
	col := func(t int64) int { return int(float64(t) / float64(tmax) * float64(cols-1)) }
	for i := 0; i < len(s); {
		c := col(s[i].t)
		best, j := i, i
		for j < len(s) && col(s[j].t) == c {
			if s[j].total() > s[best].total() {
				best = j
			}
			j++
		}
		out = append(out, s[best])
		if j-1 != best {
			out = append(out, s[j-1])
		}
		i = j
	}
	return out
}

// loadMarks returns one mark per pixel column, layer and outcome of the
// finished loads, in time order.
func loadMarks(h *history, tmax int64, cols int) []load {
	type key struct {
		col int
		loadKind
	}
	byCol := map[key]int{} // index in marks
	var marks []load
	for _, b := range h.buckets {
		for _, l := range b.loads {
			k := key{int(float64(l.t) / float64(tmax) * float64(cols-1)), l.loadKind}
			if i, ok := byCol[k]; ok {
				marks[i].t, marks[i].n = min(marks[i].t, l.t), marks[i].n+l.n
				continue
			}
			byCol[k] = len(marks)
			marks = append(marks, l)
		}
	}
	slices.SortStableFunc(marks, func(a, b load) int {
		return cmp.Or(cmp.Compare(a.t, b.t), cmp.Compare(a.layer, b.layer), cmp.Compare(b2i(a.prefetch), b2i(b.prefetch)), cmp.Compare(b2i(a.failed), b2i(b.failed)))
	})
	return marks
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// step is one level of a band: from time t on, between lo and hi bytes.
type step struct{ t, lo, hi int64 }

// bandSteps returns the levels of category ci's band, one per change.
func bandSteps(samples []sample, ci int) (steps []step, used bool) {
	for _, s := range samples {
		var lo int64
		for _, v := range s.cats[:ci] {
			lo += v
		}
		hi := lo + s.cats[ci]
		used = used || s.cats[ci] != 0
		n := len(steps)
		switch {
		case n > 0 && steps[n-1].lo == lo && steps[n-1].hi == hi:
		case n > 0 && steps[n-1].t == s.t:
			steps[n-1].lo, steps[n-1].hi = lo, hi
		default:
			steps = append(steps, step{s.t, lo, hi})
		}
	}
	return steps, used
}

// The drawing's margins around the plot, and the height of the load lane
// under it.
const (
	marginLeft, marginRight, marginTop = 90, 190, 50
	lane                               = 70
)

func plotWidth(width int) int { return width - marginLeft - marginRight }

func render(snap *paging.Snapshot, h *history, width, height int) string {
	const left, top = marginLeft, marginTop
	bottom := 40 + lane
	pw, ph := float64(plotWidth(width)), float64(height-top-bottom)
	tmax := max(h.tmax, 1)
	samples := thin(h.samples(), tmax, int(pw))
	peak := max(h.peak, snap.Peak) // the history may have started late or lost events
	drawLimit := snap.Limit > 0 && snap.Limit <= maxCharged && snap.Limit/limitFactor <= peak
	hi := peak
	if drawLimit {
		hi = max(hi, snap.Limit)
	}
	ymax, ystep, unit := axis(hi + hi/20)
	x := func(t int64) float64 { return float64(left) + float64(t)/float64(tmax)*pw }
	y := func(b int64) float64 { return float64(top) + ph - float64(b)/float64(ymax)*ph }

	var sb strings.Builder
	fmt.Fprintf(&sb, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", width, height, width, height)
	fmt.Fprintf(&sb, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&sb, `<text x="%d" y="22" font-size="15" font-weight="bold">Device memory of %s by category: %s, peak %s</text>`+"\n",
		left, esc(snap.Device), budgetText(snap.Limit), paging.FormatSize(snap.Peak))
	// stacked areas, one polygon per category: a step function of time,
	// its upper edge left to right, then its lower edge right to left
	for ci, c := range categories {
		steps, used := bandSteps(samples, ci)
		if !used {
			continue
		}
		end := func(i int) int64 {
			if i+1 < len(steps) {
				return steps[i+1].t
			}
			return tmax
		}
		pts := make([]string, 0, 4*len(steps))
		for i, s := range steps {
			pts = append(pts, pt(x(s.t), y(s.hi)), pt(x(end(i)), y(s.hi)))
		}
		for i := len(steps) - 1; i >= 0; i-- {
			pts = append(pts, pt(x(end(i)), y(steps[i].lo)), pt(x(steps[i].t), y(steps[i].lo)))
		}
		fmt.Fprintf(&sb, `<polygon class="category" data-category="%s" fill="%s" fill-opacity="0.85" stroke="none" points="%s"/>`+"\n",
			esc(c.name), c.color, strings.Join(pts, " "))
	}
	// axes and grid
	fmt.Fprintf(&sb, `<line x1="%d" y1="%d" x2="%d" y2="%.1f" stroke="black"/>`+"\n", left, top, left, float64(top)+ph)
	fmt.Fprintf(&sb, `<line x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", left, float64(top)+ph, float64(left)+pw, float64(top)+ph)
	for b := int64(0); b <= ymax; b += ystep {
		fmt.Fprintf(&sb, `<line x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#ddd"/><text class="ytick" data-bytes="%d" x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n",
			left, y(b), float64(left)+pw, y(b), b, left-6, y(b)+4, tickLabel(b, unit))
	}
	for i := 0; i <= 5; i++ {
		t := int64(float64(tmax) * float64(i) / 5)
		fmt.Fprintf(&sb, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", x(t), float64(top)+ph+16, fmtTime(t))
	}
	// budget and peak lines, labelled at their right end: the budget above
	// its line, the peak below its own, so the two never overlap
	const halo = `paint-order="stroke" stroke="white" stroke-width="3"`
	if drawLimit {
		fmt.Fprintf(&sb, `<line class="limit" x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#c00" stroke-width="1.5" stroke-dasharray="6 4"/><text x="%.1f" y="%.1f" fill="#c00" text-anchor="end" %s>budget</text>`+"\n",
			left, y(snap.Limit), float64(left)+pw, y(snap.Limit), float64(left)+pw-4, y(snap.Limit)-4, halo)
	}
	fmt.Fprintf(&sb, `<line class="peak" x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black" stroke-dasharray="2 3"/><text x="%.1f" y="%.1f" text-anchor="end" %s>peak</text>`+"\n",
		left, y(peak), float64(left)+pw, y(peak), float64(left)+pw-4, y(peak)+13, halo)
	// load lane: one mark per pixel column, layer and outcome of the
	// finished loads, its height the layer number
	laneTop := float64(top) + ph + 28
	fmt.Fprintf(&sb, `<text x="%d" y="%.1f" text-anchor="end">layer loads</text>`+"\n", left-6, laneTop+float64(lane)/2)
	fmt.Fprintf(&sb, `<rect x="%d" y="%.1f" width="%.1f" height="%d" fill="#f6f6f6"/>`+"\n", left, laneTop, pw, lane-10)
	for _, l := range loadMarks(h, tmax, int(pw)) {
		ly := laneTop + float64(lane-10) - float64(l.layer+1)/float64(h.maxLayer+1)*float64(lane-14)
		color, what := "#333", ""
		switch {
		case l.failed:
			color, what = "#c00", " (failed)"
		case l.prefetch:
			color, what = "#59a14f", " (prefetch)"
		}
		if l.n > 1 {
			what += fmt.Sprintf(", %d loads", l.n)
		}
		fmt.Fprintf(&sb, `<circle class="load" cx="%.1f" cy="%.1f" r="1.8" fill="%s"><title>layer %d at %s%s</title></circle>`+"\n",
			x(l.t), ly, color, l.layer, fmtTime(l.t), what)
	}
	// legend: the budget, the peak, and the final value of each category
	lx, ly := float64(left)+pw+10, float64(top)
	if drawLimit {
		fmt.Fprintf(&sb, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#c00" stroke-width="1.5" stroke-dasharray="6 4"/><text x="%.1f" y="%.1f" fill="#c00">%s</text>`+"\n",
			lx, ly, lx+12, ly, lx+18, ly+4, budgetText(snap.Limit))
	} else {
		text := budgetText(snap.Limit)
		if snap.Limit < noBudget {
			text += ", off the chart"
		}
		fmt.Fprintf(&sb, `<text class="budget-note" x="%.1f" y="%.1f" fill="#c00">%s</text>`+"\n", lx, ly+4, text)
	}
	fmt.Fprintf(&sb, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black" stroke-dasharray="2 3"/><text x="%.1f" y="%.1f">peak %s</text>`+"\n",
		lx, ly+18, lx+12, ly+18, lx+18, ly+22, paging.FormatSize(peak))
	ly += 40
	for ci, c := range categories {
		fmt.Fprintf(&sb, `<rect x="%.1f" y="%.1f" width="12" height="12" fill="%s"/><text x="%.1f" y="%.1f">%s</text><text x="%.1f" y="%.1f" fill="#555">at end %s</text>`+"\n",
			lx, ly, c.color, lx+18, ly+10, esc(c.name), lx+18, ly+24, paging.FormatSize(h.cur[ci]))
		ly += 36
	}
	for i, l := range []struct{ color, name string }{{"#333", "demand load"}, {"#59a14f", "prefetch"}, {"#c00", "failed"}} {
		fmt.Fprintf(&sb, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/><text x="%.1f" y="%.1f">%s</text>`+"\n",
			lx+6, laneTop+8+float64(i)*16, l.color, lx+18, laneTop+12+float64(i)*16, l.name)
	}
	if text, leak := endNote(snap, h.total); text != "" {
		class, color := "note", "#555"
		if leak {
			class, color = "leak", "#c00"
		}
		fmt.Fprintf(&sb, `<text class="%s" x="%d" y="%d" fill="%s">%s</text>`+"\n", class, left, height-8, color, esc(text))
	}
	if snap.DroppedEvents > 0 {
		fmt.Fprintf(&sb, `<text x="%d" y="38" fill="#c00">%d events were not recorded (history full): the drawing is incomplete</text>`+"\n", left, snap.DroppedEvents)
	}
	sb.WriteString("</svg>\n")
	return sb.String()
}

// endNote says what the bytes still charged at the end of the history
// mean, and whether they are a leak: only when the budget was closed.
func endNote(snap *paging.Snapshot, end int64) (text string, leak bool) {
	var leaked int64
	var parts []string
	for _, c := range snap.Categories {
		if c.Leaked > 0 {
			leaked += c.Leaked
			parts = append(parts, fmt.Sprintf("%s %s", paging.FormatSize(c.Leaked), c.Category))
		}
	}
	switch {
	case leaked > 0:
		return fmt.Sprintf("a leak: closing the budget found %s still allocated (%s) and freed it", paging.FormatSize(leaked), strings.Join(parts, ", ")), true
	case end == 0:
		return "", false
	case snap.DroppedEvents > 0:
		return "", false // the history stops early: its end is not the snapshot's
	case snap.Closed == nil:
		return fmt.Sprintf("%s still charged at the end of the history (the snapshot does not say whether the budget was closed)", paging.FormatSize(end)), false
	case *snap.Closed:
		return fmt.Sprintf("a leak: %s still charged after the budget was closed", paging.FormatSize(end)), true
	default:
		return fmt.Sprintf("%s still charged: the snapshot was taken with the budget open, so these allocations are live, not leaked", paging.FormatSize(end)), false
	}
}

func pt(x, y float64) string {
	return strconv.FormatFloat(x, 'f', 1, 64) + "," + strconv.FormatFloat(y, 'f', 1, 64)
}

func esc(s string) string { return html.EscapeString(s) }

func fmtTime(ns int64) string {
	switch {
	case ns >= 10e9:
		return fmt.Sprintf("%.0f s", float64(ns)/1e9)
	case ns >= 1e9:
		return fmt.Sprintf("%.2f s", float64(ns)/1e9)
	case ns >= 1e6:
		return fmt.Sprintf("%.1f ms", float64(ns)/1e6)
	default:
		return fmt.Sprintf("%.0f µs", float64(ns)/1e3)
	}
}

func page(snap *paging.Snapshot, svg string) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>memory of %s</title>\n", esc(snap.Device))
	sb.WriteString("<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{padding:2px 10px;text-align:right;border-bottom:1px solid #ddd}td:first-child,th:first-child{text-align:left}</style></head><body>\n")
	fmt.Fprintf(&sb, "<h1>Device memory of %s</h1>\n%s", esc(snap.Device), svg)
	sb.WriteString("<h2>Categories</h2>\n<table><tr><th>category</th><th>allocated</th><th>peak allocated</th><th>reserved</th><th>peak reserved</th><th>allocs</th><th>frees</th><th>leaked</th></tr>\n")
	for _, c := range snap.Categories {
		fmt.Fprintf(&sb, "<tr><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td>%d</td><td>%d</td><td>%s</td></tr>\n", esc(c.Category),
			paging.FormatSize(c.Allocated), paging.FormatSize(c.PeakAllocated), paging.FormatSize(c.Reserved), paging.FormatSize(c.PeakReserved), c.Allocs, c.Frees, paging.FormatSize(c.Leaked))
	}
	sb.WriteString("</table>\n")
	for _, p := range snap.Pagers {
		fmt.Fprintf(&sb, "<h2>Pager %d (%s)</h2>\n<p>%d acquires: %d hits, %d misses; %d loads, %d evictions; disk to host %s, host to device %s; %s per step after the first.</p>\n",
			p.Pager, esc(string(p.Strategy)), p.Acquires, p.Hits, p.Misses, p.Loads, p.Evictions,
			paging.FormatSize(p.BytesDiskToHost), paging.FormatSize(p.BytesHostToDevice), paging.FormatSize(int64(p.BytesPerStep)))
	}
	sb.WriteString("</body></html>\n")
	return sb.String()
}
