package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"unicode/utf8"

	"github.com/strata-llm/strata/internal/infile"
)

// ReadDocs reads the documents of a training text file: a .jsonl file
// holds one JSON object {"text": "..."} a line (blank lines are skipped),
// any other file is one document of UTF-8 text. A line that is not such
// an object, or text that is not UTF-8, is an error naming the file and
// the line.
func ReadDocs(ctx context.Context, path string) ([]string, error) {
	b, err := infile.ReadFile(ctx, path)
	if err != nil {
		return nil, err
	}
	if !strings.EqualFold(filepath.Ext(path), ".jsonl") {
		if !utf8.Valid(b) {
			return nil, fmt.Errorf("%s is not UTF-8 text", path)
		}
		return []string{string(b)}, nil
	}
	var docs []string
	for i, line := range bytes.Split(b, []byte("\n")) {
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var d struct {
			Text *string `json:"text"`
		}
		if err := json.Unmarshal(line, &d); err != nil || d.Text == nil {
			return nil, fmt.Errorf("%s:%d: not a JSON object with a \"text\" string", path, i+1)
		}
		if !utf8.ValidString(*d.Text) {
			return nil, fmt.Errorf("%s:%d: the text is not UTF-8", path, i+1)
		}
		docs = append(docs, *d.Text)
	}
	if len(docs) == 0 {
		return nil, fmt.Errorf("%s holds no document", path)
	}
	return docs, nil
}
