package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/paging"
)

// Row is one line of the comparison table.
type Row struct {
	Result
	// BoundTokS is the streaming bound (pinned GB/s over the bytes that must
	// cross the link per token) or, with nothing streamed, the device-memory
	// bound (device GB/s over the weight bytes).
	BoundTokS   float64 `json:"bound_tok_s"`
	Bound       string  `json:"bound"` // "stream" or "device"
	OfBound     float64 `json:"of_bound"`
	VsBaseline  float64 `json:"vs_baseline"` // decode tok/s over the baseline's
	BaselineRun string  `json:"baseline"`    // which: accelerate at the same budget, else transformers resident
}

func report(files []string, mdPath, jsonPath string, stdout io.Writer) error {
	var ceil *Ceilings
	var results []Result
	for _, path := range files {
		f, err := infile.Open(path)
		if err != nil {
			return err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for n := 1; sc.Scan(); n++ {
			line := sc.Bytes()
			if len(strings.TrimSpace(string(line))) == 0 {
				continue
			}
			var kind struct{ Kind string }
			if err := json.Unmarshal(line, &kind); err != nil {
				f.Close()
				return fmt.Errorf("%s:%d: %w", path, n, err)
			}
			if kind.Kind == "ceilings" {
				ceil = new(Ceilings)
				if err := json.Unmarshal(line, ceil); err != nil {
					f.Close()
					return fmt.Errorf("%s:%d: %w", path, n, err)
				}
				continue
			}
			var r Result
			if err := json.Unmarshal(line, &r); err != nil {
				f.Close()
				return fmt.Errorf("%s:%d: %w", path, n, err)
			}
			results = append(results, r)
		}
		f.Close()
		if err := sc.Err(); err != nil {
			return err
		}
	}
	rows := make([]Row, 0, len(results))
	for _, r := range results {
		row := Row{Result: r}
		if ceil != nil && r.Error == "" {
			if r.StreamedBytes > 0 && ceil.PinnedGBps > 0 {
				row.Bound, row.BoundTokS = "stream", ceil.PinnedGBps*1e9/float64(r.StreamedBytes)
			} else if ceil.DeviceGBps > 0 && r.WeightBytes > 0 {
				row.Bound, row.BoundTokS = "device", ceil.DeviceGBps*1e9/float64(r.WeightBytes)
			}
			if row.BoundTokS > 0 {
				row.OfBound = r.DecodeTokS / row.BoundTokS
			}
		}
		if base := baseline(results, r); base != nil && base.DecodeTokS > 0 {
			row.VsBaseline, row.BaselineRun = r.DecodeTokS/base.DecodeTokS, base.Kind+" "+base.Run
		}
		rows = append(rows, row)
	}
	md := markdown(ceil, rows)
	fmt.Fprint(stdout, md)
	if mdPath != "" {
		if err := atomicfile.WriteFile(mdPath, []byte(md)); err != nil {
			return fmt.Errorf("-md: %w", err)
		}
	}
	if jsonPath != "" {
		b, err := json.MarshalIndent(struct {
			Ceilings *Ceilings `json:"ceilings"`
			Rows     []Row     `json:"rows"`
		}{ceil, rows}, "", "  ")
		if err != nil {
			return err
		}
		if err := atomicfile.WriteFile(jsonPath, b); err != nil {
			return fmt.Errorf("-json: %w", err)
		}
	}
	return nil
}

// baseline is accelerate at the same model and budget, else transformers
// with everything resident.
func baseline(all []Result, r Result) *Result {
	var resident *Result
	for i := range all {
		b := &all[i]
		if b.Model != r.Model || b.Error != "" {
			continue
		}
		if b.Kind == "accelerate" && b.BudgetBytes == r.BudgetBytes && r.BudgetBytes > 0 {
			return b
		}
		if b.Kind == "transformers" && b.BudgetBytes == 0 {
			resident = b
		}
	}
	if r.BudgetBytes == 0 {
		return resident
	}
	return nil
}

func markdown(c *Ceilings, rows []Row) string {
	var sb strings.Builder
	if c != nil {
		fmt.Fprintf(&sb, "Ceilings on %s: host-to-device %.1f GB/s pinned, %.1f GB/s pageable (%s copies); device memory %.0f GB/s (read + write).\n\n",
			c.Device, c.PinnedGBps, c.PageableGBps, paging.FormatSize(c.CopyBytes), c.DeviceGBps)
	}
	sb.WriteString("| model | system | budget | strategy | mode | decode tok/s | prefill 128 | prefill 512 | moved/token | H2D GB/s | overlap | peak device | bound tok/s | of bound | vs baseline |\n")
	sb.WriteString("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n")
	for _, r := range rows {
		budget := "none"
		if r.BudgetBytes > 0 {
			budget = paging.FormatSize(r.BudgetBytes)
		}
		if r.Error != "" {
			fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s | error: %s |||||||||||\n", r.Model, r.Kind, budget, r.Strategy, r.Mode, strings.ReplaceAll(r.Error, "|", "/"))
			continue
		}
		vs := "-"
		if r.VsBaseline > 0 {
			vs = fmt.Sprintf("%.2fx %s", r.VsBaseline, r.BaselineRun)
		}
		bound := "-"
		if r.BoundTokS > 0 {
			bound = fmt.Sprintf("%.1f (%s)", r.BoundTokS, r.Bound)
		}
		of := "-"
		if r.OfBound > 0 {
			of = fmt.Sprintf("%.0f%%", 100*r.OfBound)
		}
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s | %.2f | %.0f | %.0f | %s | %.1f | %.2f | %s | %s | %s | %s |\n",
			r.Model, r.Kind, budget, r.Strategy, r.Mode, r.DecodeTokS, r.PrefillTokS["128"], r.PrefillTokS["512"],
			paging.FormatSize(int64(r.BytesPerToken)), r.H2DGBps, r.Overlap, paging.FormatSize(r.PeakDeviceBytes), bound, of, vs)
	}
	return sb.String()
}
