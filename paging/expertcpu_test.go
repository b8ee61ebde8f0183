package paging

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"
)

// TestExpertCPUTime: with rates like an H200 host's (a link of 50 GB/s, a
// CPU reading 100 GB/s, a hand-over of 20 µs) the CPU computes a cold
// Mixtral-8x7B Q8_0 expert (187 MB) for one token sooner than the link
// uploads it, and for four tokens later; without a rate nothing is
// predicted.
func TestExpertCPUTime(t *testing.T) {
	h200 := Rates{H2D: 50e9, CPU: 100e9, Handoff: 20 * time.Microsecond}
	const expert = 187e6
	for _, tc := range []struct {
		name    string
		r       Rates
		tokens  int
		cpuWins bool
		ok      bool
	}{
		{"decode", h200, 1, true, true},
		{"prefill of 4", h200, 4, false, true},
		{"no tokens counts one", h200, 0, true, true},
		{"no CPU rate", Rates{H2D: 50e9}, 1, false, false},
		{"no link rate", Rates{CPU: 100e9}, 1, false, false},
	} {
		cpu, upload, ok := ExpertCPUTime(tc.r, expert, tc.tokens)
		if ok != tc.ok || ok && (cpu < upload) != tc.cpuWins {
			t.Errorf("%s: CPU %v, upload %v, ok %v; want the CPU first %v, ok %v", tc.name, cpu, upload, ok, tc.cpuWins, tc.ok)
		}
	}
}

// TestHostExpert: ExpertOnCPU says yes for an expert out of the cache
// under the always policy, no for a cached one, and no under never;
// HostExpert serves the expert's bytes from host memory (read from the
// source once, then from the host cache, uploading nothing), counted in
// Stats. A failed read counts nothing, keeps nothing and pins nothing, and
// the next call serves the expert.
func TestHostExpert(t *testing.T) {
	ctx := context.Background()
	m := newMoESynth(2, 6, 8, 16)
	pg, _, fb, _ := newExpertPager(t, m, 2, Options{ExpertsCPU: ExpertCPUAlways})
	acquireCheck(t, pg, m, fb, 1, 0)
	if pg.ExpertOnCPU(1, 0, 1) || !pg.ExpertOnCPU(1, 3, 1) || pg.ExpertOnCPU(0, 0, 1) || pg.ExpertOnCPU(1, 6, 1) {
		t.Errorf("ExpertOnCPU: cached %v, missing %v, a layer without experts %v, out of range %v; want false, true, false, false",
			pg.ExpertOnCPU(1, 0, 1), pg.ExpertOnCPU(1, 3, 1), pg.ExpertOnCPU(0, 0, 1), pg.ExpertOnCPU(1, 6, 1))
	}

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

	never, _, _, _ := newExpertPager(t, newMoESynth(2, 6, 8, 16), 2, Options{ExpertsCPU: ExpertCPUNever})
	auto, _, _, _ := newExpertPager(t, newMoESynth(2, 6, 8, 16), 2, Options{ExpertsCPU: ExpertCPUAuto})
	if never.ExpertOnCPU(1, 3, 1) || auto.ExpertOnCPU(1, 3, 1) {
		t.Error("never, or auto without rates, hands an expert to the CPU")
	}
	if _, err := ParseExpertCPUPolicy("sometimes"); err == nil {
		t.Error("ParseExpertCPUPolicy accepts sometimes")
	}
}
