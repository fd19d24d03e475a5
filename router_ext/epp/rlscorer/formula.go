// Package rlscorer is the Go twin of router_ext/scorer.py: the moerl RL-aware
// endpoint scoring formula, with no dependency on llm-d so it can be tested
// (and reused) without the router.
//
// The formula, its rationale and the exact order of floating-point operations
// are documented in router_ext/scorer.py; both implementations replay
// router_ext/testdata/vectors.json and must agree to 1e-12 and on every pick.
package rlscorer

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"
)

// Components lists the component names in summation order.
var Components = []string{"load", "queue", "kv", "prefix", "version", "affinity"}

// Signals is what the router knows about one endpoint (see EndpointSignals in
// scorer.py for where each field comes from).
type Signals struct {
	Name          string  `json:"name"`
	InFlight      int     `json:"inFlight"`
	Waiting       int     `json:"waiting"`
	KVUsage       float64 `json:"kvUsage"`
	PrefixMatch   float64 `json:"prefixMatch"`
	PolicyVersion int     `json:"policyVersion"`
	Updating      bool    `json:"updating"`
}

// Weights are the per-component weights; JSON names match the llm-d plugin
// parameters and the Python ScorerParams.to_plugin_parameters output.
type Weights struct {
	Load     float64 `json:"load"`
	Queue    float64 `json:"queue"`
	KV       float64 `json:"kv"`
	Prefix   float64 `json:"prefix"`
	Version  float64 `json:"version"`
	Affinity float64 `json:"affinity"`
}

// Params are the moerl-rl-scorer plugin parameters.
type Params struct {
	Weights          Weights `json:"weights"`
	LoadFactor       float64 `json:"loadFactor"`
	VersionLagWindow int     `json:"versionLagWindow"`
	VirtualNodes     int     `json:"virtualNodes"`
}

// DefaultParams mirrors the defaults of ScorerParams in scorer.py.
func DefaultParams() Params {
	return Params{
		Weights:          Weights{Load: 1, Queue: 2, KV: 1, Prefix: 3, Version: 2, Affinity: 2},
		LoadFactor:       1.5,
		VersionLagWindow: 4,
		VirtualNodes:     128,
	}
}

// Validate applies the same checks as ScorerParams.__post_init__.
func (p Params) Validate() error {
	w := p.Weights
	for _, v := range []float64{w.Load, w.Queue, w.KV, w.Prefix, w.Version, w.Affinity} {
		if v < 0 {
			return fmt.Errorf("weights must be >= 0, got %v", w)
		}
	}
	if p.LoadFactor < 1 {
		return fmt.Errorf("loadFactor must be >= 1 (bounded loads need c >= 1), got %v", p.LoadFactor)
	}
	if p.VersionLagWindow < 1 {
		return fmt.Errorf("versionLagWindow must be >= 1, got %d", p.VersionLagWindow)
	}
	if p.VirtualNodes < 1 {
		return fmt.Errorf("virtualNodes must be >= 1, got %d", p.VirtualNodes)
	}
	return nil
}

// WeightSum is the normalisation constant, summed in component order.
func (p Params) WeightSum() float64 {
	w := p.Weights
	return w.Load + w.Queue + w.KV + w.Prefix + w.Version + w.Affinity
}

// Result holds per-endpoint values in input order. Pick and Home are indexes
// into the input, or -1 (no active endpoint / no affinity key).
type Result struct {
	Components map[string][]float64
	Totals     []float64
	Normalized []float64
	Pick       int
	Home       int
}

// Hash64 is the first 8 bytes of SHA-256, big endian (same as scorer.hash64).
func Hash64(s string) uint64 {
	sum := sha256.Sum256([]byte(s))
	return binary.BigEndian.Uint64(sum[:8])
}

type ring struct {
	hashes []uint64
	owners []int
}

// ringCache keeps rings per endpoint set: the set changes rarely (pause,
// resume, scale), requests arrive constantly. Bounded to avoid growth when
// the set churns.
var ringCache sync.Map // string -> *ring
var ringCacheSize int64
var ringCacheMu sync.Mutex

func getRing(names []string, virtualNodes int) *ring {
	key := fmt.Sprintf("%d\x00%s", virtualNodes, strings.Join(names, "\x00"))
	if r, ok := ringCache.Load(key); ok {
		return r.(*ring)
	}
	type point struct {
		h    uint64
		name string
		idx  int
	}
	pts := make([]point, 0, len(names)*virtualNodes)
	for i, n := range names {
		for v := 0; v < virtualNodes; v++ {
			pts = append(pts, point{Hash64(fmt.Sprintf("%s#%d", n, v)), n, i})
		}
	}
	sort.Slice(pts, func(a, b int) bool {
		if pts[a].h != pts[b].h {
			return pts[a].h < pts[b].h
		}
		if pts[a].name != pts[b].name {
			return pts[a].name < pts[b].name
		}
		return pts[a].idx < pts[b].idx
	})
	r := &ring{hashes: make([]uint64, len(pts)), owners: make([]int, len(pts))}
	for i, p := range pts {
		r.hashes[i], r.owners[i] = p.h, p.idx
	}
	ringCacheMu.Lock()
	if ringCacheSize >= 64 {
		ringCache.Range(func(k, _ any) bool { ringCache.Delete(k); return true })
		ringCacheSize = 0
	}
	ringCacheSize++
	ringCacheMu.Unlock()
	ringCache.Store(key, r)
	return r
}

// LoadCapacity is the bound on one endpoint's load: ceil(loadFactor*(sum(loads)+1)/n).
func LoadCapacity(loads []int, loadFactor float64) float64 {
	total := 0
	for _, l := range loads {
		total += l
	}
	return math.Ceil(loadFactor * float64(total+1) / float64(len(loads)))
}

// HomeEndpoint returns key's home index among names: consistent hashing with
// bounded loads (LoadCapacity over the active endpoints' loads). active lists
// the indices that may take the key (nil: all); the ring holds every name and
// the walk passes the others (home_endpoint in scorer.py says why).
func HomeEndpoint(key string, names []string, loads []int, loadFactor float64, virtualNodes int, active []int) int {
	if len(names) == 0 {
		return -1
	}
	if active == nil {
		active = make([]int, len(names))
		for i := range active {
			active[i] = i
		}
	}
	if len(active) == 0 {
		return -1
	}
	allowed := make([]bool, len(names))
	activeLoads := make([]int, len(active))
	for j, i := range active {
		allowed[i], activeLoads[j] = true, loads[i]
	}
	capacity := LoadCapacity(activeLoads, loadFactor)
	r := getRing(names, virtualNodes)
	m := len(r.hashes)
	h := Hash64(key)
	start := sort.Search(m, func(i int) bool { return r.hashes[i] >= h })
	for step := 0; step < m; step++ {
		i := r.owners[(start+step)%m]
		if allowed[i] && float64(loads[i]) < capacity {
			return i
		}
	}
	panic("unreachable: some endpoint is always below capacity")
}

// PrefixMatch is the fraction of a prompt's complete blocks an endpoint holds
// (prefix_match in scorer.py, where the reason is written down): cached of
// total blocks as a prefix producer reports them, over min(total,
// promptTokens/blockTokens) when promptTokens > 0.
func PrefixMatch(cachedBlocks, totalBlocks, promptTokens, blockTokens int) float64 {
	full := totalBlocks
	if promptTokens > 0 && blockTokens > 0 {
		full = min(full, promptTokens/blockTokens)
	}
	if full <= 0 {
		return 0
	}
	return float64(min(max(cachedBlocks, 0), full)) / float64(full)
}

func clamp01(x float64) float64 {
	if x < 0 {
		return 0
	}
	if x > 1 {
		return 1
	}
	return x
}

// Score scores endpoints for a request with the given affinity key ("" or
// hasKey=false means no key) and picks one. Every product is wrapped in an
// explicit float64 conversion, which forbids the compiler from fusing it into
// an FMA, so the sums round exactly like Python's.
func Score(eps []Signals, affinityKey string, hasKey bool, p Params, withComponents bool) Result {
	n := len(eps)
	res := Result{Totals: make([]float64, n), Normalized: make([]float64, n), Pick: -1, Home: -1}
	if withComponents {
		res.Components = make(map[string][]float64, len(Components))
		for _, c := range Components {
			res.Components[c] = make([]float64, n)
		}
	}
	active := make([]int, 0, n)
	current := math.MinInt
	for i, e := range eps {
		if e.PolicyVersion > current {
			current = e.PolicyVersion
		}
		if !e.Updating {
			active = append(active, i)
		}
	}
	if len(active) == 0 {
		return res
	}
	maxIF, maxWait := math.MinInt, math.MinInt
	for _, i := range active {
		maxIF = max(maxIF, eps[i].InFlight)
		maxWait = max(maxWait, eps[i].Waiting)
	}
	loads := make([]int, n)
	names := make([]string, n)
	activeLoads := make([]int, 0, len(active))
	for i, e := range eps {
		loads[i], names[i] = e.InFlight+e.Waiting, e.Name
	}
	for _, i := range active {
		activeLoads = append(activeLoads, loads[i])
	}
	capacity := LoadCapacity(activeLoads, p.LoadFactor)
	if hasKey {
		res.Home = HomeEndpoint(affinityKey, names, loads, p.LoadFactor, p.VirtualNodes, active)
	}
	w := p.Weights
	window := p.VersionLagWindow
	bestTotal := -1.0
	for _, i := range active {
		e := eps[i]
		sLoad, sQueue := 1.0, 1.0
		if maxIF > 0 {
			sLoad = 1.0 - float64(e.InFlight)/float64(maxIF)
		}
		if maxWait > 0 {
			sQueue = 1.0 - float64(e.Waiting)/float64(maxWait)
		}
		sKV := 1.0 - clamp01(e.KVUsage)
		sPrefix := 0.0 // past the load bound a replica's cache no longer pulls (scorer.py)
		if float64(loads[i]) < capacity {
			sPrefix = clamp01(e.PrefixMatch)
		}
		lag := min(current-e.PolicyVersion, window)
		sVersion := 1.0 - float64(lag)/float64(window)
		sAff := 0.0
		if i == res.Home {
			sAff = 1.0
		}
		t := float64(w.Load*sLoad) + float64(w.Queue*sQueue)
		t = t + float64(w.KV*sKV)
		t = t + float64(w.Prefix*sPrefix)
		t = t + float64(w.Version*sVersion)
		t = t + float64(w.Affinity*sAff)
		res.Totals[i] = t
		if t > bestTotal || (t == bestTotal && e.Name < eps[res.Pick].Name) {
			res.Pick, bestTotal = i, t
		}
		if withComponents {
			res.Components["load"][i] = sLoad
			res.Components["queue"][i] = sQueue
			res.Components["kv"][i] = sKV
			res.Components["prefix"][i] = sPrefix
			res.Components["version"][i] = sVersion
			res.Components["affinity"][i] = sAff
		}
	}
	if ws := p.WeightSum(); ws > 0 {
		for i := range res.Totals {
			res.Normalized[i] = res.Totals[i] / ws
		}
	}
	return res
}
