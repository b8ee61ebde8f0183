package loader

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"testing"
)

// rawFile is a safetensors file taken apart by a minimal parser written for
// the tests, independent of ReadHeader.
type rawFile struct {
	header map[string]any
	data   []byte // everything after the header
}

func readRaw(t testing.TB, path string) *rawFile {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(b)
	var h map[string]any
	if err := json.Unmarshal(b[8:8+n], &h); err != nil {
		t.Fatal(err)
	}
	return &rawFile{header: h, data: b[8+n:]}
}

// tensorBytes returns the bytes the header's data_offsets name.
func (r *rawFile) tensorBytes(t testing.TB, name string) []byte {
	t.Helper()
	e, ok := r.header[name].(map[string]any)
	if !ok {
		t.Fatalf("no tensor %s", name)
	}
	off := e["data_offsets"].([]any)
	return r.data[int(off[0].(float64)):int(off[1].(float64))]
}

// writeRaw writes a safetensors file with the given header (any JSON value
// or raw bytes) and data, with the header length as declared (-1: the
// real one).
func writeRaw(t testing.TB, path string, header any, data []byte, declared int64) {
	t.Helper()
	var hb []byte
	switch h := header.(type) {
	case []byte:
		hb = h
	case string:
		hb = []byte(h)
	default:
		var err error
		if hb, err = json.Marshal(h); err != nil {
			t.Fatal(err)
		}
	}
	n := uint64(len(hb))
	if declared >= 0 {
		n = uint64(declared)
	}
	out := binary.LittleEndian.AppendUint64(nil, n)
	out = append(out, hb...)
	out = append(out, data...)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

// rewrite applies mutate to path's header and writes the file back with the
// same data.
func rewrite(t testing.TB, path string, mutate func(h map[string]any)) {
	t.Helper()
	r := readRaw(t, path)
	mutate(r.header)
	writeRaw(t, path, r.header, r.data, -1)
}

func entry(dtype string, shape []int, begin, end int64) map[string]any {
	return map[string]any{"dtype": dtype, "shape": shape, "data_offsets": []int64{begin, end}}
}
