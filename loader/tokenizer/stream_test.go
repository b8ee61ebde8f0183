package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"
)

// streamAll decodes ids through a Stream and returns the concatenation.
func streamAll(t testing.TB, s *Stream, ids []int) string {
	t.Helper()
	var b strings.Builder
	for _, id := range ids {
		piece, err := s.Add(id)
		if err != nil {
			t.Fatalf("Add(%d): %v", id, err)
		}
		b.WriteString(piece)
	}
	b.WriteString(s.Flush())
	return b.String()
}

func TestStreamReferenceCases(t *testing.T) {
	for _, f := range allFixtures(t) {
		st := f.tok.NewStream() // reused across cases: Flush starts a new sequence
		for _, c := range f.cases {
			if got := streamAll(t, st, c.IDs); got != c.Decoded {
				t.Errorf("%s: stream of %v = %q, want %q", f.name, c.IDs, got, c.Decoded)
			}
		}
	}
}

// TestStreamRandomIDs checks the Stream against Decode on random id
// sequences, which are full of broken UTF-8, lone byte tokens, special
// tokens and spaces at odd places.
func TestStreamRandomIDs(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	n := 2000
	if testing.Short() {
		n = 300
	}
	for _, f := range allFixtures(t) {
		v := f.tok.VocabSize()
		for k := 0; k < n; k++ {
			ids := make([]int, rng.IntN(24))
			for i := range ids {
				ids[i] = rng.IntN(v)
				if rng.IntN(3) == 0 { // favour the low ids: specials and byte tokens
					ids[i] = rng.IntN(min(v, 260))
				}
			}
			want, err := f.tok.Decode(ids)
			if err != nil {
				t.Fatalf("%s: Decode(%v): %v", f.name, ids, err)
			}
			if got := streamAll(t, f.tok.NewStream(), ids); got != want {
				t.Fatalf("%s: stream of %v = %q, Decode = %q", f.name, ids, got, want)
			}
		}
	}
}

// TestStreamHoldsIncompleteText checks that pieces returned mid-stream are
// valid UTF-8 and that a multi-byte character split over tokens comes out
// whole, once.
func TestStreamHoldsIncompleteText(t *testing.T) {
	for _, f := range allFixtures(t) {
		for _, c := range f.cases {
			st := f.tok.NewStream()
			for _, id := range c.IDs {
				piece, err := st.Add(id)
				if err != nil {
					t.Fatal(err)
				}
				if !utf8.ValidString(piece) || strings.ContainsRune(piece, utf8.RuneError) {
					t.Errorf("%s: case %q: Add(%d) returned %q, an incomplete character", f.name, c.Text, id, piece)
				}
			}
			st.Flush()
		}
	}
}

func TestDecodeUnknownID(t *testing.T) {
	for _, f := range allFixtures(t) {
		for _, id := range []int{-1, f.tok.VocabSize(), 1 << 40} {
			if _, err := f.tok.Decode([]int{0, id}); err == nil {
				t.Errorf("%s: Decode with id %d: no error", f.name, id)
			}
			if _, err := f.tok.NewStream().Add(id); err == nil {
				t.Errorf("%s: Stream.Add(%d): no error", f.name, id)
			}
		}
	}
}

// randomText returns a string drawn from ASCII, Latin-1, combining marks,
// CJK, emoji, various spaces and digits of other scripts, and the special
// tokens' spellings.
func randomText(rng *rand.Rand) string {
	pools := []string{
		"abcXYZ etaoin shrdlu", "0123456789", " \t\n\r  ", ".,;:!?'\"()[]{}-_/\\@#$%^&*+=<>|~`",
		"éàüñçøßÆœ", "\u0301\u0308\u0327", "显存不足的困境与解决方案", "🚀😀👍🏽🇫🇷",
		"\u00a0\u2002\u3000\u2028\u0085", "٣٤٥१२३", "'s 'T 're 'LL ſ", "<s></s><unk>▁",
	}
	var b strings.Builder
	n := rng.IntN(40)
	for i := 0; i < n; i++ {
		pool := []rune(pools[rng.IntN(len(pools))])
		if rng.IntN(8) == 0 {
			b.WriteString([]string{"<s>", "</s>", "<unk>", "<0x41>"}[rng.IntN(4)])
			continue
		}
		b.WriteRune(pool[rng.IntN(len(pool))])
	}
	return b.String()
}

func TestByteLevelRoundTrip(t *testing.T) {
	f := loadFixture(t, "tiny-llama-f16-sharded")
	rng := rand.New(rand.NewPCG(3, 4))
	n := 3000
	if testing.Short() {
		n = 300
	}
	for k := 0; k < n; k++ {
		s := randomText(rng)
		if k%10 == 0 { // arbitrary code points too
			rs := make([]rune, rng.IntN(12))
			for i := range rs {
				rs[i] = rune(rng.IntN(0x30000))
				if !utf8.ValidRune(rs[i]) {
					rs[i] = 'x'
				}
			}
			s = string(rs)
		}
		ids, err := f.tok.Encode(s, false)
		if err != nil {
			t.Fatalf("Encode(%q): %v", s, err)
		}
		got, err := f.tok.Decode(ids)
		if err != nil {
			t.Fatalf("Decode(%v): %v", ids, err)
		}
		if got != s {
			t.Fatalf("Decode(Encode(%q)) = %q (ids %v)", s, got, ids)
		}
	}
}

// TestEncodeDecodeRandomText runs both fixtures over random text: encoding
// never fails, every id decodes, and the stream agrees with Decode.
func TestEncodeDecodeRandomText(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, f := range allFixtures(t) {
		for k := 0; k < 500; k++ {
			s := randomText(rng)
			ids, err := f.tok.Encode(s, k%2 == 0)
			if err != nil {
				t.Fatalf("%s: Encode(%q): %v", f.name, s, err)
			}
			want, err := f.tok.Decode(ids)
			if err != nil {
				t.Fatalf("%s: Decode(%v): %v", f.name, ids, err)
			}
			if got := streamAll(t, f.tok.NewStream(), ids); got != want {
				t.Fatalf("%s: stream of Encode(%q) = %q, Decode = %q", f.name, s, got, want)
			}
		}
	}
}

func TestEncodeInvalidUTF8(t *testing.T) {
	for _, f := range allFixtures(t) {
		if _, err := f.tok.Encode("ok \xff\xfe", false); err == nil {
			t.Errorf("%s: Encode of invalid UTF-8: no error", f.name)
		}
	}
}

// TestConcurrentEncode encodes from several goroutines at once (the word
// cache is shared); run it with -race.
func TestConcurrentEncode(t *testing.T) {
	for _, f := range allFixtures(t) {
		done := make(chan error)
		for g := 0; g < 4; g++ {
			go func(g int) {
				rng := rand.New(rand.NewPCG(uint64(g), 11))
				for k := 0; k < 200; k++ {
					s := randomText(rng)
					a, err := f.tok.Encode(s, false)
					if err != nil {
						done <- err
						return
					}
					b, _ := f.tok.Encode(s, false) // now from the cache
					if !equalIDs(a, b) {
						done <- fmt.Errorf("%s: Encode(%q) gave %v then %v", f.name, s, a, b)
						return
					}
				}
				done <- nil
			}(g)
		}
		for g := 0; g < 4; g++ {
			if err := <-done; err != nil {
				t.Error(err)
			}
		}
	}
}
