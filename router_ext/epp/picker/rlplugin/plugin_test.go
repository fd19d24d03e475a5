package rlplugin

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	fwkdl "github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requestcontrol"
	fwkrh "github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requesthandling"
	fwksched "github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	attrmetrics "github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/datalayer/attribute/metrics"
	attrprefix "github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/datalayer/attribute/prefix"

	"github.com/moerl/moerl/router_ext/epp/rlscorer"
)

type vcase struct {
	Name    string          `json:"name"`
	Params  json.RawMessage `json:"params"`
	Request struct {
		AffinityKey *string `json:"affinityKey"`
	} `json:"request"`
	Endpoints []rlscorer.Signals `json:"endpoints"`
	Expected  struct {
		Normalized []float64 `json:"normalized"`
		Pick       *string   `json:"pick"`
	} `json:"expected"`
}

// toEndpoint builds the i-th llm-d endpoint carrying the signals the way the
// EPP's data layer would: queue and KV usage from the core extractor, prefix
// info from a prefix producer, RL values as custom scalar attributes. Its
// in-flight count is not an attribute: the scorer counts the requests it
// routed (route).
func toEndpoint(i int, s rlscorer.Signals) fwksched.Endpoint {
	m := fwkdl.NewMetrics()
	m.WaitingQueueSize, m.KVCacheUsagePercent = s.Waiting, s.KVUsage
	m.RunningRequestsSize = 1000 // the scraped gauge, which the scorer must not read
	attrs := fwkdl.NewAttributes()
	match := int(math.Round(math.Min(math.Max(s.PrefixMatch, 0), 1) * 10000))
	attrs.Put(attrprefix.PrefixCacheMatchInfoDataKey.String(), attrprefix.NewPrefixCacheMatchInfo(match, 10000, 16))
	attrs.Put(DefaultPolicyVersionAttribute, attrmetrics.ScalarMetricValue(s.PolicyVersion))
	upd := 0.0
	if s.Updating {
		upd = 1
	}
	attrs.Put(DefaultUpdatingAttribute, attrmetrics.ScalarMetricValue(upd))
	return fwksched.NewEndpoint(&fwkdl.EndpointMetadata{Name: s.Name, Address: "127.0.0.1", Port: strconv.Itoa(8000 + i)},
		m, attrs)
}

// route passes request id through the scorer's PreRequest hook as llm-d's
// director does once ep is picked.
func route(t *testing.T, s *Scorer, id string, ep fwksched.Endpoint) {
	t.Helper()
	res := &fwksched.SchedulingResult{PrimaryProfileName: "default", ProfileResults: map[string]*fwksched.ProfileRunResult{
		"default": {TargetEndpoints: []fwksched.Endpoint{ep}}}}
	if err := s.PreRequest(context.Background(), &fwksched.InferenceRequest{RequestID: id}, res); err != nil {
		t.Fatal(err)
	}
}

// answer passes a response chunk of request id through the scorer's response hook.
func answer(s *Scorer, id string, end bool) {
	s.ResponseBody(context.Background(), &fwksched.InferenceRequest{RequestID: id},
		&requestcontrol.Response{RequestID: id, EndOfStream: end}, nil)
}

func TestVectorsThroughLLMDInterface(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "..", "testdata", "vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct{ Cases []vcase }
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	for _, c := range doc.Cases {
		t.Run(c.Name, func(t *testing.T) {
			p, err := ScorerFactory("rl", decoder(c.Params), nil)
			if err != nil {
				t.Fatal(err)
			}
			s := p.(*Scorer)
			req := &fwksched.InferenceRequest{RequestID: "r", Headers: map[string]string{}}
			if c.Request.AffinityKey != nil {
				req.Headers["X-Moerl-Affinity-Key"] = *c.Request.AffinityKey
			}
			eps := make([]fwksched.Endpoint, len(c.Endpoints))
			for i, sig := range c.Endpoints {
				eps[i] = toEndpoint(i, sig)
				for j := range sig.InFlight {
					route(t, s, fmt.Sprintf("%d-%d", i, j), eps[i])
				}
			}
			scores := s.Score(context.Background(), req, eps)
			kept := map[fwksched.Endpoint]bool{}
			f, _ := FilterFactory("f", nil, nil)
			for _, ep := range f.(*PausedFilter).Filter(context.Background(), req, eps) {
				kept[ep] = true
			}
			best, bestName := -1.0, ""
			for i, ep := range eps {
				got, want := scores[ep], c.Expected.Normalized[i]
				if math.Abs(got-want) > 1e-9 || got < 0 || got > 1 {
					t.Errorf("%s: score %.12g, want %.12g", c.Endpoints[i].Name, got, want)
				}
				if kept[ep] == c.Endpoints[i].Updating {
					t.Errorf("%s: filter kept=%v for updating=%v", c.Endpoints[i].Name, kept[ep], c.Endpoints[i].Updating)
				}
				name := c.Endpoints[i].Name
				if kept[ep] && (got > best || (got == best && name < bestName)) {
					best, bestName = got, name
				}
			}
			if c.Expected.Pick == nil {
				if len(kept) != 0 {
					t.Errorf("all paused, but filter kept %d", len(kept))
				}
			} else if bestName != *c.Expected.Pick {
				t.Errorf("max score after filter picks %s, want %s", bestName, *c.Expected.Pick)
			}
		})
	}
}

func TestRegisterAndStrictParams(t *testing.T) {
	Register()
	if _, ok := plugin.Registry[ScorerType]; !ok {
		t.Fatal("scorer not registered")
	}
	if _, ok := plugin.Registry[FilterType]; !ok {
		t.Fatal("filter not registered")
	}
	if _, err := ScorerFactory("x", decoder([]byte(`{"weights":{"prefx":1}}`)), nil); err == nil {
		t.Error("misspelt weight accepted")
	}
	p, err := ScorerFactory("x", decoder([]byte(`{"affinityHeaders":["X-Session-Id"],"loadFactor":1.5}`)), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := p.(*Scorer)
	if s.cfg.LoadFactor != 1.5 || s.cfg.Weights.Prefix != 3 {
		t.Errorf("params not merged over defaults: %+v", s.cfg)
	}
	if k, ok := s.AffinityKey(&fwksched.InferenceRequest{Headers: map[string]string{"x-session-id": "s1"}}); !ok || k != "s1" {
		t.Errorf("affinity key %q %v", k, ok)
	}
}

func TestInFlightFollowsTheRequestHooks(t *testing.T) {
	p, _ := ScorerFactory("rl", nil, nil)
	s := p.(*Scorer)
	a, b := toEndpoint(0, rlscorer.Signals{Name: "a"}), toEndpoint(1, rlscorer.Signals{Name: "b"})
	inFlight := func() [2]int { return [2]int{s.Signals(a, 0).InFlight, s.Signals(b, 0).InFlight} }
	route(t, s, "r1", a)
	route(t, s, "r2", a)
	route(t, s, "r3", b)
	if got := inFlight(); got != [2]int{2, 1} {
		t.Fatalf("after three requests routed: %v", got)
	}
	answer(s, "r1", false) // a chunk, not the end
	if got := inFlight(); got != [2]int{2, 1} {
		t.Fatalf("a chunk ended a request: %v", got)
	}
	answer(s, "r1", true)
	answer(s, "r1", true)      // the end reported twice counts once
	answer(s, "unknown", true) // never routed
	route(t, s, "r3", a)       // re-scheduled: moves from b to a
	if got := inFlight(); got != [2]int{2, 0} {
		t.Fatalf("after r1 answered and r3 moved: %v", got)
	}
	answer(s, "r2", true)
	answer(s, "r3", true)
	if got := inFlight(); got != [2]int{0, 0} || len(s.inFlight.byReq) != 0 || len(s.inFlight.count) != 0 {
		t.Fatalf("after every answer: %v, %d ids, %d endpoints kept", got, len(s.inFlight.byReq), len(s.inFlight.count))
	}
}

func TestPrefixIsScoredOverTheCompleteBlocks(t *testing.T) {
	p, _ := ScorerFactory("rl", nil, nil)
	s := p.(*Scorer)
	ep := func(cached, total int) fwksched.Endpoint {
		attrs := fwkdl.NewAttributes()
		attrs.Put(attrprefix.PrefixCacheMatchInfoDataKey.String(), attrprefix.NewPrefixCacheMatchInfo(cached, total, 32))
		return fwksched.NewEndpoint(&fwkdl.EndpointMetadata{Name: "e", Address: "127.0.0.1", Port: "8000"},
			fwkdl.NewMetrics(), attrs)
	}
	req := func(n int) *fwksched.InferenceRequest {
		return &fwksched.InferenceRequest{RequestID: "r", Headers: map[string]string{}, Body: &fwkrh.InferenceRequestBody{
			TokenizedPrompt: &fwkrh.TokenizedPrompt{PerPromptTokens: [][]uint32{make([]uint32, n)}}}}
	}
	// 100 tokens in blocks of 32: 3 complete blocks and a partial one, which no replica caches
	for _, c := range []struct {
		cached, total, tokens int
		want                  float64
	}{{3, 4, 100, 1}, {2, 4, 100, 2.0 / 3}, {3, 4, 0, 0.75}, {0, 1, 20, 0}} {
		e := ep(c.cached, c.total)
		if got := s.Signals(e, promptTokens(req(c.tokens))).PrefixMatch; math.Abs(got-c.want) > 1e-12 {
			t.Errorf("%d of %d blocks cached, %d tokens: prefix %v, want %v", c.cached, c.total, c.tokens, got, c.want)
		}
	}
	if promptTokens(nil) != 0 || promptTokens(&fwksched.InferenceRequest{}) != 0 {
		t.Error("a request without a tokenized prompt has a length")
	}
}
