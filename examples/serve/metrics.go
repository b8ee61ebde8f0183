package main

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/strata-llm/strata/engine"
)

// metrics are what GET /metrics shows, in a registry of the server's own.
type metrics struct {
	reg               *prometheus.Registry
	requests          *prometheus.CounterVec
	promptTokens      prometheus.Counter
	completionTokens  prometheus.Counter
	timeToFirstToken  prometheus.Histogram
	interTokenLatency prometheus.Histogram
}

// newMetrics registers the server's metrics, the batcher's gauges and the
// engine's paging counters (read at each scrape).
func newMetrics(eng *engine.Engine, b *engine.Batcher) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "strata_requests_total", Help: "HTTP requests by endpoint and status code.",
		}, []string{"endpoint", "status"}),
		promptTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "strata_prompt_tokens_total", Help: "Prompt tokens of the requests run.",
		}),
		completionTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "strata_completion_tokens_total", Help: "Tokens generated.",
		}),
		timeToFirstToken: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "strata_time_to_first_token_seconds", Help: "Time from a request's arrival to its first generated token.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
		}),
		interTokenLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "strata_inter_token_latency_seconds", Help: "Time between two generated tokens of a request.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
	}
	m.reg.MustRegister(m.requests, m.promptTokens, m.completionTokens, m.timeToFirstToken, m.interTokenLatency)
	m.reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "strata_batch_size", Help: "Requests running now."},
			func() float64 { return float64(b.Stats().Running) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "strata_queue_length", Help: "Requests waiting to run."},
			func() float64 { return float64(b.Stats().Queued) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "strata_batch_steps_total", Help: "Decode steps of the batcher."},
			func() float64 { return float64(b.Stats().Steps) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "strata_batch_sequences_total", Help: "Sequences stepped, summed over steps (over strata_batch_steps_total: the mean batch size)."},
			func() float64 { return float64(b.Stats().BatchSizeSum) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "strata_rejected_total", Help: "Requests the batcher refused (queue full, larger than the KV pool, shutting down)."},
			func() float64 { return float64(b.Stats().Rejected) }),
		&pagingCollector{eng: eng},
		stepCollector{b: b},
	)
	return m
}

// handler serves the registry.
func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// count records a finished request.
func (m *metrics) count(endpoint string, status int) {
	m.requests.WithLabelValues(endpoint, strconv.Itoa(status)).Inc()
}

// stepCollector reads the batcher's steps' time by part once per scrape
// (engine.StepSplit): over strata_batch_steps_total, a step's.
type stepCollector struct{ b *engine.Batcher }

var stepSeconds = prometheus.NewDesc("strata_batch_step_seconds_total",
	"The batcher's steps' time by part: schedule, prepare, launch, wait, download, sample (which add up to the steps' time) and device (the device's own time, during launch and wait).",
	[]string{"part"}, nil)

func (c stepCollector) Describe(ch chan<- *prometheus.Desc) { ch <- stepSeconds }

func (c stepCollector) Collect(ch chan<- prometheus.Metric) {
	sp := c.b.Stats().StepSplit
	for _, p := range []struct {
		part string
		d    time.Duration
	}{{"schedule", sp.Schedule}, {"prepare", sp.Prepare}, {"launch", sp.Launch}, {"wait", sp.Wait}, {"download", sp.Download}, {"sample", sp.Sample}, {"device", sp.Device}} {
		ch <- prometheus.MustNewConstMetric(stepSeconds, prometheus.CounterValue, p.d.Seconds(), p.part)
	}
}

// pagingCollector reads the engine's paging statistics once per scrape.
type pagingCollector struct{ eng *engine.Engine }

var (
	pagingDescs = map[string]*prometheus.Desc{}
	pagingNames = []struct{ name, help string }{
		{"strata_layer_acquires_total", "Layer acquires of the pagers."},
		{"strata_layer_hits_total", "Layer acquires that found the layer on the device."},
		{"strata_layer_misses_total", "Layer acquires that waited for a load."},
		{"strata_layer_loads_total", "Layer loads."},
		{"strata_layer_evictions_total", "Layer evictions."},
		{"strata_bytes_disk_to_host_total", "Bytes read from the weights' files."},
		{"strata_bytes_host_to_device_total", "Bytes uploaded to the devices."},
		{"strata_expert_hits_total", "Experts found in the expert cache."},
		{"strata_expert_misses_total", "Experts loaded into the expert cache."},
	}
	deviceUsed   = prometheus.NewDesc("strata_device_used_bytes", "Bytes a device's budget holds now (weights, KV caches, buffers).", []string{"index", "device"}, nil)
	deviceBudget = prometheus.NewDesc("strata_device_budget_bytes", "A device's memory budget.", []string{"index", "device"}, nil)
)

func init() {
	for _, n := range pagingNames {
		pagingDescs[n.name] = prometheus.NewDesc(n.name, n.help, nil, nil)
	}
}

func (c *pagingCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, n := range pagingNames {
		ch <- pagingDescs[n.name]
	}
	ch <- deviceUsed
	ch <- deviceBudget
}

func (c *pagingCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.eng.Stats()
	for name, v := range map[string]int64{
		"strata_layer_acquires_total":       st.Acquires,
		"strata_layer_hits_total":           st.Hits,
		"strata_layer_misses_total":         st.Misses,
		"strata_layer_loads_total":          st.Loads,
		"strata_layer_evictions_total":      st.Evictions,
		"strata_bytes_disk_to_host_total":   st.BytesDiskToHost,
		"strata_bytes_host_to_device_total": st.BytesHostToDevice,
		"strata_expert_hits_total":          st.ExpertHits,
		"strata_expert_misses_total":        st.ExpertMisses,
	} {
		ch <- prometheus.MustNewConstMetric(pagingDescs[name], prometheus.CounterValue, float64(v))
	}
	for i, d := range c.eng.Devices() {
		ch <- prometheus.MustNewConstMetric(deviceUsed, prometheus.GaugeValue, float64(d.UsedBytes), strconv.Itoa(i), d.Name)
		ch <- prometheus.MustNewConstMetric(deviceBudget, prometheus.GaugeValue, float64(d.BudgetBytes), strconv.Itoa(i), d.Name)
	}
}
