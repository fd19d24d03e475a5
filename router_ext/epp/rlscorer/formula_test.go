package rlscorer

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// vectorsPath points at the file shared with the Python tests.
var vectorsPath = filepath.Join("..", "..", "testdata", "vectors.json")

type vectorCase struct {
	Name    string          `json:"name"`
	Params  json.RawMessage `json:"params"`
	Request struct {
		AffinityKey *string `json:"affinityKey"`
	} `json:"request"`
	Endpoints []Signals `json:"endpoints"`
	Expected  struct {
		Components map[string][]float64 `json:"components"`
		Totals     []float64            `json:"totals"`
		Normalized []float64            `json:"normalized"`
		Home       *string              `json:"home"`
		Pick       *string              `json:"pick"`
	} `json:"expected"`
	IntendedPick *string `json:"intendedPick"`
}

type vectorDoc struct {
	Hashes []struct {
		Input  string `json:"input"`
		Hash64 string `json:"hash64"`
	} `json:"hashes"`
	PrefixMatches []struct {
		CachedBlocks int     `json:"cachedBlocks"`
		TotalBlocks  int     `json:"totalBlocks"`
		PromptTokens int     `json:"promptTokens"`
		BlockTokens  int     `json:"blockTokens"`
		PrefixMatch  float64 `json:"prefixMatch"`
	} `json:"prefixMatches"`
	Cases []vectorCase `json:"cases"`
}

func loadVectors(t *testing.T) vectorDoc {
	t.Helper()
	raw, err := os.ReadFile(vectorsPath)
	if err != nil {
		t.Fatalf("read vectors: %v", err)
	}
	var doc vectorDoc
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatalf("decode vectors: %v", err)
	}
	if len(doc.Cases) < 20 {
		t.Fatalf("only %d cases in %s", len(doc.Cases), vectorsPath)
	}
	return doc
}

func TestHashVectors(t *testing.T) {
	for _, h := range loadVectors(t).Hashes {
		want, err := strconv.ParseUint(h.Hash64, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		if got := Hash64(h.Input); got != want {
			t.Errorf("Hash64(%q) = %d, want %d", h.Input, got, want)
		}
	}
}

func TestPrefixMatchVectors(t *testing.T) {
	doc := loadVectors(t)
	if len(doc.PrefixMatches) == 0 {
		t.Fatal("no prefixMatches in the vectors")
	}
	for _, v := range doc.PrefixMatches {
		if got := PrefixMatch(v.CachedBlocks, v.TotalBlocks, v.PromptTokens, v.BlockTokens); math.Abs(got-v.PrefixMatch) > 1e-12 {
			t.Errorf("PrefixMatch(%d, %d, %d, %d) = %v, want %v", v.CachedBlocks, v.TotalBlocks, v.PromptTokens,
				v.BlockTokens, got, v.PrefixMatch)
		}
	}
}

func nameOr(eps []Signals, i int) *string {
	if i < 0 {
		return nil
	}
	return &eps[i].Name
}

func eqStr(a, b *string) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func show(s *string) string {
	if s == nil {
		return "<none>"
	}
	return *s
}

func TestVectors(t *testing.T) {
	for _, c := range loadVectors(t).Cases {
		t.Run(c.Name, func(t *testing.T) {
			p, err := ParseParams(c.Params)
			if err != nil {
				t.Fatalf("params: %v", err)
			}
			key, hasKey := "", c.Request.AffinityKey != nil
			if hasKey {
				key = *c.Request.AffinityKey
			}
			res := Score(c.Endpoints, key, hasKey, p, true)
			close := func(what string, got, want []float64) {
				if len(got) != len(want) {
					t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
				}
				for i := range got {
					if math.Abs(got[i]-want[i]) > 1e-12 {
						t.Errorf("%s[%s] = %.17g, want %.17g", what, c.Endpoints[i].Name, got[i], want[i])
					}
				}
			}
			for _, comp := range Components {
				close(comp, res.Components[comp], c.Expected.Components[comp])
			}
			close("totals", res.Totals, c.Expected.Totals)
			close("normalized", res.Normalized, c.Expected.Normalized)
			if got := nameOr(c.Endpoints, res.Pick); !eqStr(got, c.Expected.Pick) {
				t.Errorf("pick = %s, want %s", show(got), show(c.Expected.Pick))
			}
			if got := nameOr(c.Endpoints, res.Home); !eqStr(got, c.Expected.Home) {
				t.Errorf("home = %s, want %s", show(got), show(c.Expected.Home))
			}
			if c.IntendedPick != nil && !eqStr(c.IntendedPick, c.Expected.Pick) {
				t.Errorf("intended pick %s differs from expected %s", show(c.IntendedPick), show(c.Expected.Pick))
			}
		})
	}
}

func TestParseParamsRejectsUnknownAndInvalid(t *testing.T) {
	if _, err := ParseParams([]byte(`{"weights":{"latency":1}}`)); err == nil {
		t.Error("unknown weight accepted")
	}
	if _, err := ParseParams([]byte(`{"loadFactor":0.5}`)); err == nil {
		t.Error("loadFactor < 1 accepted")
	}
	p, err := ParseParams([]byte(`{"weights":{"prefix":5}}`))
	if err != nil {
		t.Fatal(err)
	}
	d := DefaultParams()
	if p.Weights.Prefix != 5 || p.Weights.Queue != d.Weights.Queue || p.LoadFactor != d.LoadFactor {
		t.Errorf("partial params did not keep defaults: %+v", p)
	}
	if p, err := ParseParams(nil); err != nil || p != d {
		t.Errorf("empty params: %+v, %v", p, err)
	}
}

func TestPausedNeverPicked(t *testing.T) {
	eps := []Signals{{Name: "a", Updating: true, PrefixMatch: 1}, {Name: "b", InFlight: 50, KVUsage: 0.99}}
	if r := Score(eps, "g", true, DefaultParams(), false); r.Pick != 1 || r.Totals[0] != 0 {
		t.Errorf("pick %d totals %v", r.Pick, r.Totals)
	}
}

func BenchmarkScore64(b *testing.B) {
	eps := make([]Signals, 64)
	for i := range eps {
		eps[i] = Signals{Name: "vllm-" + strconv.Itoa(i), InFlight: i % 17, Waiting: i % 5, KVUsage: float64(i%10) / 10, PolicyVersion: 3 + i%2}
	}
	p := DefaultParams()
	for i := 0; b.Loop(); i++ {
		Score(eps, "group-"+strconv.Itoa(i%300), true, p, false)
	}
}
