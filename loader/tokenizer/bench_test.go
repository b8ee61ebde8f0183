package tokenizer

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// benchText returns about n bytes of text that looks like prose: words of
// varied length drawn from a skewed distribution, punctuation, numbers,
// line breaks and now and then non-Latin script.
func benchText(n int) string {
	rng := rand.New(rand.NewPCG(7, 8))
	letters := "eeeeeeettttaaaooiinnsshhrrdlcumwfgypbvkjxqz"
	words := make([]string, 3000)
	for i := range words {
		l := 1 + rng.IntN(4) + rng.IntN(6)
		var w strings.Builder
		for j := 0; j < l; j++ {
			w.WriteByte(letters[rng.IntN(len(letters))])
		}
		words[i] = w.String()
	}
	var b strings.Builder
	for b.Len() < n {
		w := words[int(float64(len(words))*rng.Float64()*rng.Float64())] // frequent words recur
		switch r := rng.IntN(100); {
		case r < 3:
			w = strings.ToUpper(w[:1]) + w[1:]
		case r < 5:
			w = "显存不足的困境"[:3*(1+rng.IntN(7))]
		case r < 7:
			w = strings.Repeat("1234567890", 2)[:1+rng.IntN(8)]
		}
		b.WriteString(w)
		switch r := rng.IntN(100); {
		case r < 8:
			b.WriteString(", ")
		case r < 12:
			b.WriteString(". ")
		case r < 13:
			b.WriteString(".\n\n")
		default:
			b.WriteByte(' ')
		}
	}
	return b.String()
}

// BenchmarkEncode measures encoding throughput. "warm" reuses the word cache
// as a long-running process would; "cold" clears it before every pass.
func BenchmarkEncode(b *testing.B) {
	text := benchText(1 << 16)
	for _, f := range allFixtures(b) {
		for _, warm := range []bool{true, false} {
			name := f.name + "/cold"
			if warm {
				name = f.name + "/warm"
			}
			b.Run(name, func(b *testing.B) {
				b.SetBytes(int64(len(text)))
				ntok := 0
				for b.Loop() {
					if !warm {
						f.tok.model.mu.Lock()
						clear(f.tok.model.cache)
						f.tok.model.mu.Unlock()
					}
					ids, err := f.tok.Encode(text, false)
					if err != nil {
						b.Fatal(err)
					}
					ntok += len(ids)
				}
				b.ReportMetric(float64(ntok)/b.Elapsed().Seconds(), "tok/s")
			})
		}
	}
}

// BenchmarkStream measures decoding one id at a time.
func BenchmarkStream(b *testing.B) {
	text := benchText(1 << 16)
	for _, f := range allFixtures(b) {
		ids, err := f.tok.Encode(text, false)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(f.name, func(b *testing.B) {
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				st := f.tok.NewStream()
				for _, id := range ids {
					if _, err := st.Add(id); err != nil {
						b.Fatal(err)
					}
				}
				st.Flush()
			}
			b.ReportMetric(float64(len(ids)*b.N)/b.Elapsed().Seconds(), "tok/s")
		})
	}
}

// BenchmarkSplit measures the split expressions alone: Llama 3's through
// its scanner and through regexp2 (what it would cost without the scanner),
// Mistral-Nemo's through regexp2, one like Llama 3's without lookahead through
// Go's regexp (which, on such expressions, is slower than regexp2).
func BenchmarkSplit(b *testing.B) {
	text := benchText(1 << 16)
	scan, err := newRegexMatcher(llama3Pattern)
	if err != nil {
		b.Fatal(err)
	}
	compiled := func(expr string) matcher {
		re, err := compileOnig(expr)
		if err != nil {
			b.Fatal(err)
		}
		return re
	}
	for _, c := range []struct {
		name string
		m    matcher
	}{
		{"llama3/scanner", scan},
		{"llama3/regexp2", compiled(llama3Pattern)},
		{"mistral-nemo/regexp2", compiled(`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`)},
		{"no-lookahead/regexp", compiled(`[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s+`)},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				c.m.matches(text)
			}
		})
	}
}
