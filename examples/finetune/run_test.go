package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

const text = `The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again.
Paging layers between disk, host memory and the device lets a model run where it would not fit.
`

func writeData(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "data.txt")
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// runArgs runs the command on args, on the sharded F16 fixture when args
// name no -model: the fixtures are the tests' references, not the embedded
// default model.
func runArgs(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	if !slices.Contains(args, "-model") {
		args = append([]string{"-model", fixtures.Dir(fixtures.TinyLlamaF16Sharded)}, args...)
	}
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), args, &stdout, &stderr)
	return stdout.String(), stderr.String(), err
}

var stepLine = regexp.MustCompile(`(?m)^step (\d+)/(\d+) loss (\S+) `)

// losses reads the loss of every step from the output.
func losses(t *testing.T, out string) []float64 {
	t.Helper()
	var ls []float64
	for _, m := range stepLine.FindAllStringSubmatch(out, -1) {
		v, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, v)
	}
	return ls
}

func mean(v []float64) float64 {
	s := 0.0
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

// windowLoss is the mean next-token cross-entropy of a model directory's
// inference forward over ids.
func windowLoss(t *testing.T, dir string, ids []int32) float64 {
	t.Helper()
	lm, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	b := tensor.NewCPU(1)
	defer b.Close()
	w, err := nn.LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	m, err := nn.New(cfg, b, nil, w)
	if err != nil {
		t.Fatal(err)
	}
	s, err := m.NewSession(len(ids), len(ids))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	logits, err := s.Forward(context.Background(), ids, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	V, sum := cfg.VocabSize, 0.0
	for i := 0; i+1 < len(ids); i++ {
		z := logits[i*V : (i+1)*V]
		mx := math.Inf(-1)
		for _, v := range z {
			mx = math.Max(mx, float64(v))
		}
		e := 0.0
		for _, v := range z {
			e += math.Exp(float64(v) - mx)
		}
		sum += mx + math.Log(e) - float64(z[ids[i+1]])
	}
	return sum / float64(len(ids)-1)
}

// TestFinetuneLossFalls fine-tunes the embedded F16 model for 36 steps on a
// short text with checkpoints: the loss falls, and the saved checkpoint,
// read back by the loader and run by the inference forward, predicts the
// text better than the original model.
func TestFinetuneLossFalls(t *testing.T) {
	data := writeData(t)
	save := filepath.Join(t.TempDir(), "tuned")
	out, errOut, err := runArgs(t, "-data", data, "-steps", "36", "-seq-len", "16", "-lr", "3e-3",
		"-checkpoint-segments", "2", "-save", save)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	ls := losses(t, out)
	if len(ls) != 36 {
		t.Fatalf("%d step lines, want 36:\n%s", len(ls), out)
	}
	first, last := mean(ls[:6]), mean(ls[len(ls)-6:])
	t.Logf("mean loss of the first 6 steps %.3f, of the last 6 %.3f", first, last)
	if !(last < 0.6*first) {
		t.Errorf("the loss fell from %.3f to %.3f only", first, last)
	}
	if !strings.Contains(errOut, "saved the fine-tuned model") {
		t.Errorf("stderr does not report the save:\n%s", errOut)
	}

	src := fixtures.Dir(fixtures.TinyLlamaF16Sharded)
	tok, err := tokenizer.Load(src)
	if err != nil {
		t.Fatal(err)
	}
	enc, err := tok.Encode(text, true)
	if err != nil {
		t.Fatal(err)
	}
	var ids []int32
	for _, id := range enc[:17] {
		ids = append(ids, int32(id))
	}
	before, after := windowLoss(t, src, ids), windowLoss(t, save, ids)
	t.Logf("first window: loss %.3f before, %.3f after fine-tuning", before, after)
	if !(after < before-1) {
		t.Errorf("the saved model's loss on the text is %.3f, the original's %.3f", after, before)
	}
}

// fixtureIDs returns the fixture prompt as "-ids" text.
func fixtureIDs(t *testing.T) string {
	t.Helper()
	f, err := loader.OpenSafetensors(filepath.Join(fixtures.Dir(fixtures.TinyLlamaF16Sharded), "reference.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	x, err := f.ReadTensor(context.Background(), "input_ids")
	if err != nil {
		t.Fatal(err)
	}
	var s []string
	for _, v := range x.I64() {
		s = append(s, strconv.FormatInt(v, 10))
	}
	return strings.Join(s, ",")
}

func readAll(t *testing.T, path string) map[string][]float32 {
	t.Helper()
	f, err := loader.OpenSafetensors(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]float32{}
	for _, ti := range f.Tensors() {
		x, err := f.ReadTensor(context.Background(), ti.Name)
		if err != nil {
			t.Fatal(err)
		}
		if x.DType() != tensor.F32 {
			t.Fatalf("%s is %v, want F32", ti.Name, x.DType())
		}
		out[ti.Name] = x.F32()
	}
	return out
}

// minBudget is the smallest -gpu-memory-limit the runner plans with for T
// positions and the given segments.
func minBudget(t *testing.T, T, segments int) int64 {
	t.Helper()
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	info, err := nn.ModelInfo(lm, cfg)
	if err != nil {
		t.Fatal(err)
	}
	info.Reserve = nn.TrainReserve(cfg, T, segments, false) // the CPU keeps the gradients on the host
	_, err = paging.Plan(info, 1, paging.StrategyBalanced, 1, 1)
	var be *paging.BudgetError
	if !errors.As(err, &be) {
		t.Fatalf("a 1-byte budget planned: %v", err)
	}
	if be.Needed >= lm.WeightBytes() {
		t.Fatalf("the smallest budget %d holds every weight (%d B)", be.Needed, lm.WeightBytes())
	}
	return be.Needed
}

// TestFinetuneGradsOut writes the gradients of the fixture prompt and
// compares them with the fixture's grads.safetensors (transformers, F32):
// plainly, with 4 checkpoint segments, and with the weights paged under
// the smallest budget.
func TestFinetuneGradsOut(t *testing.T) {
	want := readAll(t, filepath.Join(fixtures.Dir(fixtures.TinyLlamaF16Sharded), "grads.safetensors"))
	ids := fixtureIDs(t)
	T := len(strings.Split(ids, ",")) - 1
	for _, extra := range [][]string{
		nil,
		{"-checkpoint-segments", "4"},
		{"-checkpoint-segments", "2", "-gpu-memory-limit", fmt.Sprintf("%dB", minBudget(t, T, 2))},
	} {
		path := filepath.Join(t.TempDir(), "grads.safetensors")
		args := append([]string{"-grads-out", path, "-ids", ids}, extra...)
		if _, errOut, err := runArgs(t, args...); err != nil {
			t.Fatalf("%v: %v\n%s", extra, err, errOut)
		}
		got := readAll(t, path)
		if len(got) != len(want) {
			t.Errorf("%v: %d tensors, the fixture %d", extra, len(got), len(want))
		}
		worst := 0.0
		for name, w := range want {
			g, ok := got[name]
			if !ok || len(g) != len(w) {
				t.Errorf("%v: %s missing or of the wrong size", extra, name)
				continue
			}
			var num, den float64
			for i := range w {
				d := float64(g[i]) - float64(w[i])
				num += d * d
				den += float64(w[i]) * float64(w[i])
			}
			e := math.Sqrt(num / den)
			worst = max(worst, e)
			if e > 1e-4 {
				t.Errorf("%v: %s: relative error %.3g", extra, name, e)
			}
		}
		t.Logf("%v: worst relative error %.2g", extra, worst)
	}
}

// TestFinetuneBudget trains under a budget smaller than the weights, which
// pages them: the losses are those of the run with every weight resident,
// and the weights moved.
func TestFinetuneBudget(t *testing.T) {
	data := writeData(t)
	args := []string{"-data", data, "-steps", "4", "-seq-len", "16", "-lr", "3e-3", "-checkpoint-segments", "2"}
	plain, errOut, err := runArgs(t, args...)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	limit := minBudget(t, 16, 2)
	paged, errOut, err := runArgs(t, append(args, "-gpu-memory-limit", fmt.Sprintf("%dB", limit))...)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	lp, lg := losses(t, plain), losses(t, paged)
	if len(lp) != 4 || len(lg) != 4 {
		t.Fatalf("step lines: %d and %d, want 4", len(lp), len(lg))
	}
	for i := range lp {
		if lp[i] != lg[i] {
			t.Errorf("step %d: loss %v paged, %v resident", i+1, lg[i], lp[i])
		}
	}
	if !strings.Contains(errOut, "weights moved") || strings.Contains(errOut, "weights moved 0 B") {
		t.Errorf("stderr does not show weights moving:\n%s", errOut)
	}
	// One byte too few fails, naming the smallest budget.
	_, _, err = runArgs(t, append(args, "-gpu-memory-limit", fmt.Sprintf("%dB", limit-1))...)
	if err == nil || !strings.Contains(err.Error(), "smallest budget") {
		t.Errorf("a budget one byte short: %v", err)
	}
}

func TestFinetuneFlags(t *testing.T) {
	data := writeData(t)
	for _, args := range [][]string{
		{},
		{"-grads-out", "x.safetensors"},
		{"-data", data, "-steps", "-1"},
		{"-data", data, "-seq-len", "0"},
		{"-data", data, "-optimizer", "lion"},
		{"-data", data, "-checkpoint-segments", "9"},
		{"-data", data, "-lr", "-1"},
		{"-data", data, "-loss-scale", "1e40"},
		{"-data", data, "-gpu-memory-limit", "lots"},
		{"-grads-out", "x.safetensors", "-ids", "1"},
		{"-grads-out", "x.safetensors", "-ids", "1,99999"},
		{"-data", data, "extra"},
		{"-data", data, "-device", "cpu:x"},
	} {
		_, _, err := runArgs(t, args...)
		if !cli.IsUsage(err) {
			t.Errorf("%q: error %v, want a usage error", args, err)
		}
	}
	if _, _, err := runArgs(t, "-data", filepath.Join(t.TempDir(), "missing.txt")); err == nil || cli.IsUsage(err) {
		t.Errorf("a missing data file: %v, want a plain error", err)
	}
	if _, _, err := runArgs(t, "-model", t.TempDir(), "-data", data); err == nil {
		t.Error("an empty model directory was accepted")
	}
	// Without the cuda build tag (or a GPU) -device cuda is refused with the
	// reason, not silently run on the CPU; so is a driver that does not
	// exist.
	if !slices.Contains(tensor.Devices(), "cuda:0") {
		if _, _, err := runArgs(t, "-data", data, "-device", "cuda"); err == nil {
			t.Error("-device cuda ran without a CUDA device")
		}
	}
	if _, _, err := runArgs(t, "-data", data, "-device", "tpu"); err == nil || cli.IsUsage(err) || !strings.Contains(err.Error(), "registered: cpu") {
		t.Errorf("-device tpu: %v, want an error listing the registered drivers", err)
	}
}
