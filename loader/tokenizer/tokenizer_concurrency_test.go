package tokenizer

import (
	"fmt"
	"strings"
	"sync"
	"testing"
)

// TestConcurrentUse shares each fixture tokenizer between goroutines that
// encode, decode and stream at once (as a service's request handlers do):
// every result equals the one computed alone. Run with -race.
func TestConcurrentUse(t *testing.T) {
	for _, fx := range allFixtures(t) {
		texts := []string{}
		for _, c := range fx.cases {
			texts = append(texts, c.Text)
		}
		for i := range 50 { // words the cache has not seen, so goroutines fill it together
			texts = append(texts, fmt.Sprintf("word%d %s %d", i, strings.Repeat("ab", i%7), i*i))
		}
		type result struct {
			ids []int
			dec string
		}
		want := make([]result, len(texts))
		for i, s := range texts {
			ids, err := fx.tok.Encode(s, true)
			if err != nil {
				t.Fatal(err)
			}
			dec, err := fx.tok.Decode(ids)
			if err != nil {
				t.Fatal(err)
			}
			want[i] = result{ids, dec}
		}
		// A fresh tokenizer, so the word cache starts empty under contention.
		tok := loadFixture(t, fx.name).tok
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := range 3 * len(texts) {
					i := (k*7 + w*13) % len(texts)
					ids, err := tok.Encode(texts[i], true)
					if err != nil || !equalIDs(ids, want[i].ids) {
						errs <- fmt.Errorf("%s: concurrent Encode(%q) = %v, %v; alone %v", fx.name, texts[i], ids, err, want[i].ids)
						return
					}
					dec, err := tok.Decode(ids)
					if err != nil || dec != want[i].dec {
						errs <- fmt.Errorf("%s: concurrent Decode = %q, %v; alone %q", fx.name, dec, err, want[i].dec)
						return
					}
					st := tok.NewStream()
					var sb strings.Builder
					for _, id := range ids {
						p, err := st.Add(id)
						if err != nil {
							errs <- err
							return
						}
						sb.WriteString(p)
					}
					if sb.WriteString(st.Flush()); sb.String() != want[i].dec {
						errs <- fmt.Errorf("%s: concurrent stream = %q, alone %q", fx.name, sb.String(), want[i].dec)
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	}
}
