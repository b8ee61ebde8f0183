// Command prepare turns the texts of Debian's fortunes and jargon-text
// packages into the training and held-out documents of examples/train's
// recipe (see ../CORPUS.md for what they are and their licenses).
//
//	go run ./examples/train/prepare -fortunes DIR [-jargon FILE] -out DIR
//	    [-heldout 0.05]
//
// -fortunes is a directory of fortune files (/usr/share/games/fortunes):
// each fortune, between lines holding only "%", is a document; the files
// of pictures (art, ascii-art) and of other languages (translate-me) are
// left out, overstrike sequences (X, backspace, Y) are reduced to Y, and
// other control characters dropped. -jargon is the Jargon File as plain
// text (jargon.txt, or jargon.txt.gz): each entry of the lexicon, from its
// ":headword:" line to the next, is a document. Documents are deduplicated
// and each goes to the held-out split when a hash of its text falls in the
// -heldout fraction, so the split does not depend on the order of files.
// It writes train.jsonl and heldout.jsonl ({"text": ...} a line) into
// -out. Exit status: 0 on success, 2 for a bad flag, 1 for any other error.
package main

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/infile"
)

func main() { cli.Main("prepare", run) }

// skipFortunes are fortune files that are not English prose.
var skipFortunes = map[string]bool{"art": true, "ascii-art": true, "translate-me": true}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var fortunes, jargon, out string
	var heldout float64
	fs := flag.NewFlagSet("prepare", flag.ContinueOnError)
	fs.StringVar(&fortunes, "fortunes", "", "`directory` of fortune files")
	fs.StringVar(&jargon, "jargon", "", "the Jargon File as text (`file`, .gz allowed)")
	fs.StringVar(&out, "out", "", "output `directory` for train.jsonl and heldout.jsonl (required)")
	fs.Float64Var(&heldout, "heldout", 0.05, "fraction of the documents held out, in [0, 0.5]")
	if err := cli.Parse(fs, args, stderr); err != nil {
		return err
	}
	switch {
	case out == "":
		return cli.Usagef("-out DIR is required")
	case fortunes == "" && jargon == "":
		return cli.Usagef("give -fortunes DIR and/or -jargon FILE")
	case !(heldout >= 0 && heldout <= 0.5):
		return cli.Usagef("-heldout %v must be in [0, 0.5]", heldout)
	}
	var docs []string
	counts := map[string]int{}
	if fortunes != "" {
		d, err := readFortunes(ctx, fortunes)
		if err != nil {
			return err
		}
		docs = append(docs, d...)
		counts["fortunes"] = len(d)
	}
	if jargon != "" {
		b, err := readMaybeGzip(ctx, jargon)
		if err != nil {
			return fmt.Errorf("-jargon: %w", err)
		}
		d := jargonEntries(string(b))
		if len(d) == 0 {
			return fmt.Errorf("-jargon %s: no lexicon entry (\":headword:\" lines) found", jargon)
		}
		docs = append(docs, d...)
		counts["jargon"] = len(d)
	}
	train, held := split(docs, heldout)
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	for name, ds := range map[string][]string{"train.jsonl": train, "heldout.jsonl": held} {
		if err := writeJSONL(filepath.Join(out, name), ds); err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "prepare: %d fortunes, %d jargon entries; %d distinct documents: %d for training (%d bytes), %d held out (%d bytes); wrote %s\n",
		counts["fortunes"], counts["jargon"], len(train)+len(held), len(train), size(train), len(held), size(held), out)
	return nil
}

func size(docs []string) int {
	n := 0
	for _, d := range docs {
		n += len(d)
	}
	return n
}

func readMaybeGzip(ctx context.Context, path string) ([]byte, error) {
	b, err := infile.ReadFile(ctx, path)
	if err != nil || !strings.HasSuffix(path, ".gz") {
		return b, err
	}
	z, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return io.ReadAll(z)
}

// readFortunes reads every fortune file of dir (not the .dat indexes nor
// the .u8 links), in name order.
func readFortunes(ctx context.Context, dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("-fortunes: %w", err)
	}
	var docs []string
	for _, e := range entries {
		name := e.Name()
		if !e.Type().IsRegular() || skipFortunes[name] || strings.Contains(name, ".") {
			continue
		}
		b, err := infile.ReadFile(ctx, filepath.Join(dir, name))
		if err != nil {
			return nil, fmt.Errorf("-fortunes: %w", err)
		}
		docs = append(docs, fortuneDocs(string(b))...)
	}
	if len(docs) == 0 {
		return nil, fmt.Errorf("-fortunes %s: no fortune file found", dir)
	}
	return docs, nil
}

// fortuneDocs cuts a fortune file at its "%" lines and cleans each part.
func fortuneDocs(text string) []string {
	var docs []string
	var cur []string
	flush := func() {
		if d := clean(strings.Join(cur, "\n")); d != "" {
			docs = append(docs, d)
		}
		cur = cur[:0]
	}
	for _, line := range strings.Split(text, "\n") {
		if strings.TrimRight(line, " \t\r") == "%" {
			flush()
			continue
		}
		cur = append(cur, line)
	}
	flush()
	return docs
}

// clean reduces overstrikes to the character struck last, drops control
// characters other than newlines and tabs and invalid UTF-8, trims the
// ends of lines and of the text.
func clean(s string) string {
	var runes []rune
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		i += n
		switch {
		case r == '\b':
			if len(runes) > 0 && runes[len(runes)-1] != '\n' {
				runes = runes[:len(runes)-1]
			}
		case r == utf8.RuneError && n == 1:
		case r < 0x20 && r != '\n' && r != '\t', r == 0x7f:
		default:
			runes = append(runes, r)
		}
	}
	lines := strings.Split(string(runes), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimRight(l, " \t\r")
	}
	return strings.Trim(strings.Join(lines, "\n"), "\n")
}

// jargonEntries cuts the lexicon of the Jargon File into entries: each
// runs from a line "   :headword: ..." to the next such line; the lexicon
// ends at the appendices ("Part III"). The three-space indent is removed.
func jargonEntries(text string) []string {
	var docs []string
	var cur []string
	in := false
	flush := func() {
		if d := clean(strings.Join(cur, "\n")); d != "" {
			docs = append(docs, d)
		}
		cur = cur[:0]
	}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.Contains(line, "Part III") && strings.TrimSpace(line) != "" && strings.HasPrefix(line, "          ") {
			break
		}
		if strings.HasPrefix(line, "   :") && strings.Count(line, ":") >= 2 && len(line) > 4 && line[4] != ' ' {
			if in {
				flush()
			}
			in = true
		}
		if in {
			cur = append(cur, strings.TrimPrefix(line, "   "))
		}
	}
	if in {
		flush()
	}
	return docs
}

// split deduplicates docs and puts each in the held-out split when the
// FNV-1a hash of its text, over 2⁶⁴, is below frac. Both come sorted.
func split(docs []string, frac float64) (train, held []string) {
	seen := map[string]bool{}
	for _, d := range docs {
		if seen[d] {
			continue
		}
		seen[d] = true
		h := fnv.New64a()
		h.Write([]byte(d))
		if float64(h.Sum64())/(1<<64) < frac {
			held = append(held, d)
		} else {
			train = append(train, d)
		}
	}
	sort.Strings(train)
	sort.Strings(held)
	return train, held
}

func writeJSONL(path string, docs []string) error {
	return atomicfile.Write(path, func(w io.Writer) error {
		bw := bufio.NewWriter(w)
		enc := json.NewEncoder(bw)
		enc.SetEscapeHTML(false)
		for _, d := range docs {
			if err := enc.Encode(struct {
				Text string `json:"text"`
			}{d}); err != nil {
				return err
			}
		}
		return bw.Flush()
	})
}
