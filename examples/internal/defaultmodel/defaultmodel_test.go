package defaultmodel

import (
	"context"
	"io/fs"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/strata-llm/strata/engine"
)

// Prompt is the prompt of `make run`; wantIDs are the embedded model's
// greedy continuation of it, recorded when the model was trained. A new
// model changes them: run `go test ./examples/internal/defaultmodel -run
// Greedy -v`, which logs the ids it got, and record them here.
const (
	prompt  = "The secret of life is"
	newToks = 24
)

var wantIDs = []int{266, 640, 1016, 49, 321, 12, 311, 375, 100, 104, 393, 764, 104}

// TestGreedyStable: the embedded model's greedy continuation of the
// prompt is the one recorded, and its tokens decode to printable text
// made mostly of letters and spaces.
func TestGreedyStable(t *testing.T) {
	lm, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	tok, err := lm.Tokenizer()
	if err != nil || tok == nil {
		t.Fatalf("tokenizer: %v, %v", tok, err)
	}
	ctx := context.Background()
	ids, err := tok.Encode(prompt, true)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := engine.Open(ctx, lm, engine.Options{Devices: []string{"cpu"}, Context: len(ids) + newToks})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	sess, err := eng.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	in := make([]int32, len(ids))
	for i, id := range ids {
		in[i] = int32(id)
	}
	var got []int
	for len(got) < newToks {
		logits, err := sess.Forward(ctx, in, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		best := 0
		for i, v := range logits {
			if v > logits[best] {
				best = i
			}
		}
		if best == tok.EOS() {
			break
		}
		got = append(got, best)
		in = []int32{int32(best)}
	}
	text, err := tok.Decode(got)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("greedy ids %v\n%q", got, prompt+text)
	if !slices.Equal(got, wantIDs) {
		t.Errorf("greedy ids %v; recorded %v (a new model? see wantIDs)", got, wantIDs)
	}
	var letters, all int
	for _, r := range text {
		if !unicode.IsPrint(r) && r != '\n' && r != '\t' {
			t.Errorf("the continuation %q holds %U, not printable", text, r)
			break
		}
		if unicode.IsLetter(r) || r == ' ' {
			letters++
		}
		all++
	}
	if all == 0 || letters*10 < all*7 {
		t.Errorf("the continuation %q is %d of %d letters and spaces; want text, at least 70%%", text, letters, all)
	}
}

// TestEmbeddedFiles: the model is complete, in files that the repository
// accepts (under 2 MB each, see `make lint`) and at most 16 MB in all.
func TestEmbeddedFiles(t *testing.T) {
	var total int64
	names := map[string]bool{}
	err := fs.WalkDir(FS(), Name, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if info.Size() > 2<<20 {
			t.Errorf("%s: %d bytes, over 2 MB", path, info.Size())
		}
		total += info.Size()
		names[strings.TrimPrefix(path, Name+"/")] = true
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"config.json", "tokenizer.json", "tokenizer_config.json"} {
		if !names[want] {
			t.Errorf("the embedded model lacks %s (has %v)", want, names)
		}
	}
	if total > 16<<20 {
		t.Errorf("the embedded model is %d bytes; want 16 MB at most", total)
	}
	lm, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	if n := lm.Config.NumParams(); n < 1e6 {
		t.Errorf("%d parameters; want a model of millions", n)
	}
}
