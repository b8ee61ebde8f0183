package paging

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"testing"
	"time"
)

// TestSplitMissesOne: one missing expert goes to the CPU when its
// product there, with the rows' hand-over down and its output's up, ends
// before its upload. With a link of 50 GB/s, a CPU reading 100 GB/s and a
// hand-over of 10 µs, a cold Mixtral-8x7B Q8_0 expert (187 MB) goes to the
// CPU for one token. A chunk's tokens read its weights once: with the
// rows' arithmetic measured (CPURows), added to the read, four tokens
// still go there and 64 do not; without it each token counts as a read,
// and four do not. Without a rate nothing goes.
func TestSplitMissesOne(t *testing.T) {
	fast := Rates{H2D: 50e9, CPU: 100e9, Handoff: 10 * time.Microsecond}
	rows := fast
	rows.CPURows = 800e9 // eight rows' arithmetic as long as one read
	const expert = 187e6
	for _, tc := range []struct {
		name   string
		r      Rates
		tokens int
		onCPU  bool
		ok     bool
	}{
		{"decode", fast, 1, true, true},
		{"prefill of 4, rows unmeasured", fast, 4, false, true},
		{"prefill of 4, one read", rows, 4, true, true},
		{"prefill of 64, its arithmetic", rows, 64, false, true},
		{"no tokens counts one", fast, 0, true, true},
		{"no CPU rate", Rates{H2D: 50e9}, 1, false, false},
		{"no link rate", Rates{CPU: 100e9}, 1, false, false},
	} {
		onCPU := []bool{false}
		cpu, link, ok := SplitMisses(tc.r, []ExpertMiss{{expert, tc.tokens}}, onCPU)
		if ok != tc.ok || onCPU[0] != tc.onCPU {
			t.Errorf("%s: on the CPU %v (CPU %v, link %v), ok %v; want %v, ok %v", tc.name, onCPU[0], cpu, link, ok, tc.onCPU, tc.ok)
		}
	}
}

// h200Issue16 are the rates the H200 measured for the Qwen3-30B-A3B shape
// (issue #16): the link 54.7 GB/s alone and 50.9 beside the CPU, the CPU
// 37.9 GB/s over one expert (97.7 alone at 16 threads, 77.5 beside copies:
// 30.1 over one expert beside them), 250.3 over a chunk's rows, a hand-over
// of 9.17 µs. There auto put 114 of a token's 229 misses on the CPU and
// decoded at 10.18 tok/s, never at 10.85; prefill 128 ran at 39 tok/s,
// never's at 86.
// h200R3b are the rates of session 5's run R3b on the H200's host (CPU
// 83.3 GB/s alone, 66.4 beside copies): the link 54.6, one expert on the
// CPU 40.1, two at once 64.2, a chunk's rows 262.2, a hand-over of 7.8 µs.
// There every expert on the CPU (always) decoded at 13.13 tok/s, every
// miss uploaded (never) at 10.99.
var h200R3b = Rates{H2D: 54.6e9, H2DShared: 53.2e9, CPU: 40.1e9, CPUShared: 40.1e9 * 66.4 / 83.3, CPUExperts: 64.2e9, CPURows: 262.2e9, Handoff: 7802 * time.Nanosecond}

var h200Issue16 = Rates{H2D: 54.7e9, H2DShared: 50.9e9, CPU: 37.9e9, CPUShared: 37.9e9 * 77.5 / 97.7, CPURows: 250.3e9, Handoff: 9170 * time.Nanosecond}

// TestSplitMisses: a layer's missing experts are split between the CPU
// and the link, the layer charged the two paths' sum (they ran in series
// on the H200), so that the sum is shortest and never longer than
// uploading every miss. With the H200's rates of issue #16 over the
// Qwen3-30B-A3B shape's experts (9.4 MB) no miss goes to the CPU, in
// decode (seven misses a block) or in a prefill chunk of 128 tokens (about
// 116 misses of 8 tokens each): each uploads sooner than the CPU computes
// it; were two experts at once to read 90 GB/s (CPUExperts) or 60, the
// seven would go to the CPU (nothing of the block uploads beside them),
// and one alone still not. With the rates of the later H200 run (R3b of
// session 5: link 54.6, two at once 64.2, where every expert on the CPU
// decoded 1.19x faster than every miss uploaded) the seven go to the CPU. On a PCIe 4 host (a link of 25 GB/s, the CPU at 40) the CPU takes a
// decode step's seven misses, and of a prefill chunk's the one chosen by
// a single token (the rows' arithmetic is added to the read); without
// CPURows each row counts as a read. The split found is the best of every
// subset of the misses. A slow CPU or rates that cannot say keep them all
// on the link; a CPU far faster than the link takes them all.
func TestSplitMisses(t *testing.T) {
	const x = 9437184 // an F16 expert of the Qwen3-30B-A3B shape
	pcie4 := Rates{H2D: 25e9, CPU: 40e9, CPURows: 320e9, Handoff: 10 * time.Microsecond}
	pcie4Shared := pcie4
	pcie4Shared.H2DShared, pcie4Shared.CPUShared = 22e9, 36e9
	h200AtOnce := h200Issue16
	h200AtOnce.CPUExperts = 90e9 // 71.4 beside copies
	h200AtOnce60 := h200Issue16
	h200AtOnce60.CPUExperts = 60e9
	rowsUnmeasured := pcie4
	rowsUnmeasured.CPURows = 0
	misses := func(n, tokens int) []ExpertMiss {
		ms := make([]ExpertMiss, n)
		for i := range ms {
			ms[i] = ExpertMiss{Bytes: x, Tokens: tokens}
		}
		return ms
	}
	chunk := []ExpertMiss{{x, 64}, {x, 8}, {x, 64}, {x, 1}}
	for _, tc := range []struct {
		name   string
		r      Rates
		misses []ExpertMiss
		want   []int // the misses on the CPU
		layer  time.Duration
		ok     bool
	}{
		{"H200 decode, seven misses", h200Issue16, misses(7, 1), nil, 1208 * time.Microsecond, true},
		{"H200 decode, one miss", h200Issue16, misses(1, 1), nil, 173 * time.Microsecond, true},
		{"H200 prefill chunk of 128", h200Issue16, misses(116, 8), nil, 20013 * time.Microsecond, true},
		{"H200 decode, seven misses, two at once at 90 GB/s", h200AtOnce, misses(7, 1), []int{0, 1, 2, 3, 4, 5, 6}, 807 * time.Microsecond, true},
		{"H200 decode, one miss, two at once at 90 GB/s", h200AtOnce, misses(1, 1), nil, 173 * time.Microsecond, true},
		{"H200 decode, seven misses, two at once at 60 GB/s", h200AtOnce60, misses(7, 1), []int{0, 1, 2, 3, 4, 5, 6}, 1174 * time.Microsecond, true},
		{"H200 R3b decode, seven misses", h200R3b, misses(7, 1), []int{0, 1, 2, 3, 4, 5, 6}, 1091 * time.Microsecond, true},
		{"H200 R3b decode, one miss", h200R3b, misses(1, 1), nil, 173 * time.Microsecond, true},
		{"H200 R3b prefill chunk of 128", h200R3b, misses(116, 8), nil, 20050 * time.Microsecond, true},
		{"PCIe 4 decode, seven misses", pcie4, misses(7, 1), []int{0, 1, 2, 3, 4, 5, 6}, 1732 * time.Microsecond, true},
		{"PCIe 4 decode, seven misses, shared rates", pcie4Shared, misses(7, 1), []int{0, 1, 2, 3, 4, 5, 6}, 1732 * time.Microsecond, true},
		{"PCIe 4 prefill chunk", pcie4, chunk, []int{3}, 1388 * time.Microsecond, true},
		{"PCIe 4 prefill chunk, rows unmeasured", rowsUnmeasured, chunk, []int{3}, 1388 * time.Microsecond, true},
		{"decode, slow CPU", Rates{H2D: 50e9, CPU: 5e9, Handoff: 10 * time.Microsecond}, misses(7, 1), nil, 1321 * time.Microsecond, true},
		{"decode, fast CPU", Rates{H2D: 50e9, CPU: 1e13, Handoff: time.Microsecond}, misses(3, 1), []int{0, 1, 2}, 7 * time.Microsecond, true},
		{"no CPU rate", Rates{H2D: 50e9}, misses(3, 1), nil, 566 * time.Microsecond, false},
		{"nothing missing", h200Issue16, nil, nil, 0, true},
	} {
		onCPU := make([]bool, len(tc.misses))
		for i := range onCPU {
			onCPU[i] = true // SplitMisses clears what it does not choose
		}
		cpu, link, ok := SplitMisses(tc.r, tc.misses, onCPU)
		var got []int
		for i, c := range onCPU {
			if c {
				got = append(got, i)
			}
		}
		layer := cpu + link
		t.Logf("%s: %v on the CPU: CPU %v, link %v", tc.name, got, cpu, link)
		if ok != tc.ok || !slices.Equal(got, tc.want) || (layer-tc.layer).Abs() > 2*time.Microsecond {
			t.Errorf("%s: %v on the CPU, layer %v (CPU %v, link %v), ok %v; want %v, %v, %v", tc.name, got, layer, cpu, link, ok, tc.want, tc.layer, tc.ok)
		}
		if !ok {
			continue
		}
		// Never longer than never: every miss uploaded, the link alone.
		var never float64
		for _, m := range tc.misses {
			never += float64(m.Bytes) / tc.r.H2D
		}
		if layer > durationOf(never)+time.Microsecond {
			t.Errorf("%s: layer %v, uploading every miss %v", tc.name, layer, durationOf(never))
		}
		if len(tc.misses) > 12 {
			continue
		}
		// The best of every subset, with SplitMisses' own costs.
		best := time.Duration(1 << 62)
		for set := range 1 << len(tc.misses) {
			sub := make([]bool, len(tc.misses))
			for i := range sub {
				sub[i] = set&(1<<i) != 0
			}
			c, l := splitTimes(tc.r, tc.misses, sub)
			best = min(best, c+l)
		}
		if layer > best+time.Microsecond {
			t.Errorf("%s: layer %v, the best split takes %v", tc.name, layer, best)
		}
	}
}

// splitTimes is the two paths' times of a given split, as SplitMisses
// counts them.
func splitTimes(r Rates, misses []ExpertMiss, onCPU []bool) (cpu, link time.Duration) {
	k := 0
	for _, c := range onCPU {
		if c {
			k++
		}
	}
	both := k > 0 && k < len(misses)
	var c, l float64
	for i, m := range misses {
		if onCPU[i] {
			c += r.expertCPU(m.Bytes, m.Tokens, r.cpuExperts(k, both)) + r.Handoff.Seconds()
		} else {
			l += float64(m.Bytes) / r.h2d(both)
		}
	}
	if k > 0 {
		c += r.Handoff.Seconds()
	}
	return durationOf(c), durationOf(l)
}

// TestExpertsOnCPU: the pager puts on the CPU only experts neither
// cached nor loading, in range, of a layer whose experts it pages; always
// takes every such expert, never and auto without rates none, and auto
// with rates those whose product on the CPU ends before their upload
// (SplitMisses): with a CPU slower than the link for each expert none of
// five misses, however many; with a faster one all five, and of an
// expert chosen by one token and one chosen by four (each row read again:
// no CPURows), only the first.
func TestExpertsOnCPU(t *testing.T) {
	m := newMoESynth(2, 8, 8, 16)
	eb := m.expertBytes()                                              // 768 bytes: 1 ms to upload
	slow := &Rates{H2D: float64(eb) * 1e3, CPU: float64(eb) / 1.5e-3}  // 1.5 ms on the CPU
	quick := &Rates{H2D: float64(eb) * 1e3, CPU: float64(eb) / 0.5e-3} // 0.5 ms
	for _, tc := range []struct {
		name    string
		opts    Options
		layer   int
		experts []int
		tokens  []int // each expert's, 1 when nil
		want    []bool
		used    []int // experts computed on the CPU before, once each
	}{
		{"always", Options{ExpertsCPU: ExpertCPUAlways}, 1, []int{0, 3, 9, -1}, nil, []bool{false, true, false, false}, nil},
		{"never", Options{ExpertsCPU: ExpertCPUNever, Rates: quick}, 1, []int{0, 3}, nil, []bool{false, false}, nil},
		{"auto without rates", Options{ExpertsCPU: ExpertCPUAuto}, 1, []int{0, 3}, nil, []bool{false, false}, nil},
		{"a layer without experts", Options{ExpertsCPU: ExpertCPUAlways}, 0, []int{0, 3}, nil, []bool{false, false}, nil},
		{"auto, slow CPU, five misses and a hit", Options{ExpertsCPU: ExpertCPUAuto, Rates: slow}, 1, []int{0, 2, 3, 4, 5, 6}, nil, []bool{false, false, false, false, false, false}, nil},
		{"auto, quick CPU, five misses and a hit", Options{ExpertsCPU: ExpertCPUAuto, Rates: quick}, 1, []int{0, 2, 3, 4, 5, 6}, nil, []bool{false, true, true, true, true, true}, nil},
		{"auto, quick CPU, one miss", Options{ExpertsCPU: ExpertCPUAuto, Rates: quick}, 1, []int{0, 3}, nil, []bool{false, true}, nil},
		{"auto, quick CPU, one token and four", Options{ExpertsCPU: ExpertCPUAuto, Rates: quick}, 1, []int{3, 4}, []int{4, 1}, []bool{false, true}, nil},
	} {
		pg, _, fb, _ := newExpertPager(t, m, 2, tc.opts)
		acquireCheck(t, pg, m, fb, 1, 0)
		for _, x := range tc.used {
			_, release, err := pg.HostExpert(context.Background(), tc.layer, x, 1)
			if err != nil {
				t.Fatal(err)
			}
			release()
		}
		tokens := tc.tokens
		if tokens == nil {
			tokens = make([]int, len(tc.experts))
			for i := range tokens {
				tokens[i] = 1
			}
		}
		got := make([]bool, len(tc.experts))
		pg.ExpertsOnCPU(tc.layer, tc.experts, tokens, got)
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: experts %v on the CPU %v, want %v", tc.name, tc.experts, got, tc.want)
		}
	}
}

// TestHostExpert: HostExpert serves the expert's bytes from host memory (read from the
// source once, then from the host cache, uploading nothing), counted in
// Stats. A failed read counts nothing, keeps nothing and pins nothing, and
// the next call serves the expert.
func TestHostExpert(t *testing.T) {
	ctx := context.Background()
	m := newMoESynth(2, 6, 8, 16)
	pg, _, fb, _ := newExpertPager(t, m, 2, Options{ExpertsCPU: ExpertCPUAlways})
	acquireCheck(t, pg, m, fb, 1, 0)

	m.mu.Lock()
	m.fail["b0.e3.down"] = 1
	m.mu.Unlock()
	before := pg.Stats()
	if _, _, err := pg.HostExpert(ctx, 1, 3, 2); !errors.Is(err, errExpertRead) {
		t.Fatalf("HostExpert with a failing read: %v", err)
	}
	st := pg.Stats()
	if st.ExpertsOnCPU != 0 || st.HostCacheBytes != before.HostCacheBytes || st.ExpertsPinned != 0 {
		t.Errorf("after the failure: %d on the CPU, host cache %d bytes (was %d), %d pinned", st.ExpertsOnCPU, st.HostCacheBytes, before.HostCacheBytes, st.ExpertsPinned)
	}
	for i := range 2 {
		reads := m.reads.Load()
		ws, release, err := pg.HostExpert(ctx, 1, 3, 2)
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range m.experts[1][3] {
			if w := ws[name]; w == nil || !bytes.Equal(w.Bytes(), m.pattern(1, name, w.NumBytes())) {
				t.Fatalf("call %d: tensor %s of expert 3: %v, not the source's bytes in host memory", i, name, w)
			}
		}
		release()
		if got, want := m.reads.Load()-reads, map[bool]int64{true: m.expertBytes()}[i == 0]; got != want {
			t.Errorf("call %d read %d bytes from the source, want %d", i, got, want)
		}
	}
	st = pg.Stats()
	if st.ExpertsOnCPU != 2 || st.ExpertCPUTokens != 4 || st.ExpertCPUBytes != 2*m.expertBytes() || st.ExpertBytesMoved != before.ExpertBytesMoved || st.ExpertsPinned != 0 {
		t.Errorf("stats: %d on the CPU for %d tokens, %d bytes; %d bytes moved (was %d), %d pinned", st.ExpertsOnCPU, st.ExpertCPUTokens, st.ExpertCPUBytes,
			st.ExpertBytesMoved, before.ExpertBytesMoved, st.ExpertsPinned)
	}
	acquireCheck(t, pg, m, fb, 1, 3) // its host copy uploads

	if _, err := ParseExpertCPUPolicy("sometimes"); err == nil {
		t.Error("ParseExpertCPUPolicy accepts sometimes")
	}
}

// TestSplitMissesParallel: charged side by side (SplitEnv=parallel), a
// decode block's seven misses on the H200 of run R3b split between the
// CPU and the link, each path shorter than the series charge's all-CPU
// layer.
func TestSplitMissesParallel(t *testing.T) {
	defer func(v bool) { splitParallel = v }(splitParallel)
	const x = 9437184
	ms := make([]ExpertMiss, 7)
	for i := range ms {
		ms[i] = ExpertMiss{Bytes: x, Tokens: 1}
	}
	onCPU := make([]bool, len(ms))
	splitParallel = false
	c0, l0, _ := SplitMisses(h200R3b, ms, onCPU)
	splitParallel = true
	c, l, ok := SplitMisses(h200R3b, ms, onCPU)
	n := 0
	for _, b := range onCPU {
		if b {
			n++
		}
	}
	t.Logf("series: CPU %v, link %v; parallel: %d on the CPU, CPU %v, link %v", c0, l0, n, c, l)
	if !ok || n == 0 || n == len(ms) || max(c, l) >= c0+l0 {
		t.Errorf("parallel: %d of %d on the CPU, CPU %v and link %v; want a split whose longer path is under the series charge's %v", n, len(ms), c, l, c0+l0)
	}
}
