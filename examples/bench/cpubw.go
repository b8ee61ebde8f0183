package main

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// A decode on the CPU is bound by the machine's read bandwidth, and on a
// shared host (a VM whose neighbours come and go) that bandwidth moves by
// half within a minute. So a CPU run measures it interleaved with the
// timed decode steps: the steps run in pieces of -bw-piece steps, the read
// bandwidth of as many goroutines as the backend has threads is measured
// before each piece and after the last (outside the decode's time), and
// each piece's rate of weight bytes read is set against the mean of the
// two measures around it. The median of the pieces' ratios is the run's
// figure: one busy moment moves one piece, not the result.

// bwBufBytes is the buffer the read bandwidth is measured on: past any
// last-level cache of the machines strata runs on.
const bwBufBytes = 256 << 20

// bwPasses is the passes over the buffer per measure; the fastest counts,
// so that the ceiling is not understated.
const bwPasses = 3

// CPUBandwidth is a run on the CPU set against the machine's read
// bandwidth measured in the same run (see above).
type CPUBandwidth struct {
	Threads int `json:"threads"`
	// ReadBytesPerToken are the weight bytes a decode step reads: every
	// layer's but the embedding table's, of which it reads one row (with
	// tied embeddings the head reads the whole table).
	ReadBytesPerToken int64   `json:"read_bytes_per_token"`
	PieceSteps        int     `json:"piece_steps"`
	Pieces            []Piece `json:"pieces"`
	// ReadGBps is the median of the bandwidth measures; DecodeGBps the
	// weight bytes read per second over the whole timed decode.
	ReadGBps    float64 `json:"read_GBps"`
	DecodeGBps  float64 `json:"decode_GBps"`
	MedianRatio float64 `json:"median_ratio"`
}

// Piece is one piece of the timed decode: its steps, their rate, and the
// read bandwidth measured just before and just after it.
type Piece struct {
	Steps      int     `json:"steps"`
	TokS       float64 `json:"tok_s"`
	GBps       float64 `json:"GBps"` // weight bytes read per second
	BeforeGBps float64 `json:"before_GBps"`
	AfterGBps  float64 `json:"after_GBps"`
	Ratio      float64 `json:"ratio"` // GBps over the mean of BeforeGBps and AfterGBps
}

// String is the run's line of output.
func (c *CPUBandwidth) String() string {
	s := fmt.Sprintf("CPU %d threads: %.1f GB/s of weights read (%.0f MB/token), read bandwidth %.1f GB/s (median of %d measures), ratio per piece of %d steps",
		c.Threads, c.DecodeGBps, float64(c.ReadBytesPerToken)/1e6, c.ReadGBps, len(c.Pieces)+1, c.PieceSteps)
	for _, p := range c.Pieces {
		s += fmt.Sprintf(" %.2f", p.Ratio)
	}
	return s + fmt.Sprintf(", median %.2f", c.MedianRatio)
}

// readBytesPerToken are the weight bytes a decode step reads (see
// CPUBandwidth.ReadBytesPerToken).
func readBytesPerToken(lm *loader.Model) int64 {
	var n int64
	for _, l := range lm.Layers() {
		if l.Kind == arch.Embedding {
			if v := lm.Config.VocabSize; v > 0 {
				n += l.Bytes / int64(v)
			}
			continue
		}
		n += l.Bytes
	}
	return n
}

// bwBuf is the buffer the bandwidth is measured on: words that are not
// zero (a page of zeros could be shared), made on first use.
var bwBuf = sync.OnceValue(func() []uint64 {
	a := make([]uint64, bwBufBytes/8)
	for i := range a {
		a[i] = uint64(i)
	}
	return a
})

var bwSink uint64

// sumWords adds the words of a in four independent chains, enough to keep
// a core's loads ahead of memory.
func sumWords(a []uint64) uint64 {
	var s0, s1, s2, s3 uint64
	for i := 0; i+8 <= len(a); i += 8 {
		s0 += a[i] + a[i+4]
		s1 += a[i+1] + a[i+5]
		s2 += a[i+2] + a[i+6]
		s3 += a[i+3] + a[i+7]
	}
	return s0 + s1 + s2 + s3
}

// readBandwidth is the fastest of bwPasses reads of the buffer, split
// among g goroutines, in GB/s.
func readBandwidth(g int) float64 {
	a := bwBuf()
	best := 0.0
	for range bwPasses {
		sums := make([]uint64, g)
		var wg sync.WaitGroup
		t0 := time.Now()
		for k := range g {
			wg.Go(func() { sums[k] = sumWords(a[k*len(a)/g : (k+1)*len(a)/g]) })
		}
		wg.Wait()
		best = max(best, float64(8*len(a))/time.Since(t0).Seconds()/1e9)
		for _, s := range sums {
			bwSink += s
		}
	}
	return best
}

// bwMeter times a decode in pieces against the read bandwidth.
type bwMeter struct {
	piece int            // steps per piece
	read  func() float64 // one bandwidth measure, GB/s
	c     CPUBandwidth
}

// timeDecode runs n decode steps and returns the time they took. With a
// meter m the steps run in pieces, the bandwidth measured around each
// (outside the time returned), and m's pieces are filled.
func timeDecode(n int, step func() error, m *bwMeter) (time.Duration, error) {
	if m == nil {
		t0 := time.Now()
		for range n {
			if err := step(); err != nil {
				return 0, err
			}
		}
		return time.Since(t0), nil
	}
	var el time.Duration
	before := m.read()
	reads := []float64{before}
	for done := 0; done < n; {
		k := min(m.piece, n-done)
		t0 := time.Now()
		for range k {
			if err := step(); err != nil {
				return 0, err
			}
		}
		d := time.Since(t0)
		after := m.read()
		reads = append(reads, after)
		m.c.Pieces = append(m.c.Pieces, piece(k, d, m.c.ReadBytesPerToken, before, after))
		before = after
		el += d
		done += k
	}
	m.c.PieceSteps = m.piece
	m.c.ReadGBps = medianOf(reads)
	m.c.DecodeGBps = float64(n) * float64(m.c.ReadBytesPerToken) / el.Seconds() / 1e9
	ratios := make([]float64, len(m.c.Pieces))
	for i, p := range m.c.Pieces {
		ratios[i] = p.Ratio
	}
	m.c.MedianRatio = medianOf(ratios)
	return el, nil
}

// piece is a piece of k steps that took d, reading perToken bytes a step,
// between bandwidth measures of before and after GB/s.
func piece(k int, d time.Duration, perToken int64, before, after float64) Piece {
	p := Piece{Steps: k, BeforeGBps: before, AfterGBps: after}
	if d > 0 {
		p.TokS = float64(k) / d.Seconds()
		p.GBps = p.TokS * float64(perToken) / 1e9
	}
	if bw := (before + after) / 2; bw > 0 {
		p.Ratio = p.GBps / bw
	}
	return p
}

// medianOf is the median of v (the mean of the middle two for an even count; 0 for none).
func medianOf(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if n := len(s); n%2 == 0 {
		return (s[n/2-1] + s[n/2]) / 2
	}
	return s[len(s)/2]
}

// newBWMeter returns the meter of a run on the CPU device alone (nil for
// any other device, for several devices, or with -bw-piece 0).
func newBWMeter(b tensor.Backend, lm *loader.Model, o options) *bwMeter {
	cpu, ok := b.(interface{ Threads() int })
	if o.bwPiece == 0 || len(o.more) > 0 || b.Name() != "cpu" || !ok {
		return nil
	}
	g := max(1, cpu.Threads())
	bwBuf() // filled before the decode and its profile
	return &bwMeter{piece: o.bwPiece, read: func() float64 { return readBandwidth(g) },
		c: CPUBandwidth{Threads: g, ReadBytesPerToken: readBytesPerToken(lm)}}
}

// cpuBandwidthMarkdown is the table of the runs measured against the read
// bandwidth ("" if none was).
func cpuBandwidthMarkdown(rows []Row) string {
	var sb strings.Builder
	for _, r := range rows {
		c := r.CPUBandwidth
		if c == nil || r.Error != "" {
			continue
		}
		if sb.Len() == 0 {
			sb.WriteString("\nCPU decode against the read bandwidth of as many goroutines as threads, measured before each piece of the timed decode and after the last: a piece's ratio is its weight bytes read per second over the mean of the two measures around it.\n\n")
			sb.WriteString("| model | run | threads | decode tok/s | read/token | weights GB/s | read bandwidth GB/s (median) | ratio per piece | median ratio |\n")
			sb.WriteString("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |\n")
		}
		ratios := make([]string, len(c.Pieces))
		for i, p := range c.Pieces {
			ratios[i] = fmt.Sprintf("%.2f", p.Ratio)
		}
		fmt.Fprintf(&sb, "| %s | %s | %d | %.2f | %s | %.1f | %.1f | %s | %.2f |\n", r.Model, r.Run, c.Threads, r.DecodeTokS,
			paging.FormatSize(c.ReadBytesPerToken), c.DecodeGBps, c.ReadGBps, strings.Join(ratios, " "), c.MedianRatio)
	}
	return sb.String()
}
