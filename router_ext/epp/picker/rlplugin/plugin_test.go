package rlplugin

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"

	fwkdl "github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
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

// toEndpoint builds an llm-d endpoint carrying the signals the way the EPP's
// data layer would: metrics from the core extractor, prefix info from the
// approx prefix producer, RL values as custom scalar attributes.
func toEndpoint(s rlscorer.Signals) fwksched.Endpoint {
	m := fwkdl.NewMetrics()
	m.RunningRequestsSize, m.WaitingQueueSize, m.KVCacheUsagePercent = s.InFlight, s.Waiting, s.KVUsage
	attrs := fwkdl.NewAttributes()
	match := int(math.Round(math.Min(math.Max(s.PrefixMatch, 0), 1) * 10000))
	attrs.Put(attrprefix.PrefixCacheMatchInfoDataKey.String(), attrprefix.NewPrefixCacheMatchInfo(match, 10000, 16))
	attrs.Put(DefaultPolicyVersionAttribute, attrmetrics.ScalarMetricValue(s.PolicyVersion))
	upd := 0.0
	if s.Updating {
		upd = 1
	}
	attrs.Put(DefaultUpdatingAttribute, attrmetrics.ScalarMetricValue(upd))
	return fwksched.NewEndpoint(&fwkdl.EndpointMetadata{Name: s.Name, Address: "127.0.0.1", Port: "8000"}, m, attrs)
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
				eps[i] = toEndpoint(sig)
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
