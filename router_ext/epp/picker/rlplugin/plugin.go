// Package rlplugin adapts the moerl scoring formula (package rlscorer) to the
// llm-d-router v0.10 endpoint-picker plugin API.
//
// It registers two plugin types:
//
//   - moerl-rl-scorer: a Scorer returning the formula's normalised total in
//     [0, 1] for each endpoint. Its inputs: the requests this picker has in
//     flight on each endpoint, counted by the scorer itself through llm-d's
//     PreRequest and response hooks (inflight.go); vLLM's waiting queue and KV
//     usage as the core metrics extractor maps them; the PrefixCacheMatchInfo
//     of llm-d's precise (KV events) or approximate prefix producer, over the
//     prompt's complete blocks; and two custom scalar attributes for
//     vllm_ext's RL metrics (policy version, weight update in progress)
//     mapped by the extractor's customMetrics.
//   - moerl-paused-filter: a Filter dropping endpoints whose update flag is
//     set. The scorer already gives them 0, but llm-d sums every scorer of
//     a profile, so only a filter guarantees a paused replica is never
//     picked whatever else the profile contains.
package rlplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/llm-d/llm-d-router/pkg/epp/framework/interface/datalayer"
	"github.com/llm-d/llm-d-router/pkg/epp/framework/interface/plugin"
	"github.com/llm-d/llm-d-router/pkg/epp/framework/interface/requestcontrol"
	fwksched "github.com/llm-d/llm-d-router/pkg/epp/framework/interface/scheduling"
	attrmetrics "github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/datalayer/attribute/metrics"
	attrprefix "github.com/llm-d/llm-d-router/pkg/epp/framework/plugins/datalayer/attribute/prefix"

	"github.com/moerl/moerl/router_ext/epp/rlscorer"
)

const (
	// ScorerType is the plugin type named in an EndpointPickerConfig.
	ScorerType = "moerl-rl-scorer"
	// FilterType is the paused-endpoint filter's plugin type.
	FilterType = "moerl-paused-filter"

	// DefaultPolicyVersionAttribute is the endpoint attribute holding vllm_ext's policy version.
	DefaultPolicyVersionAttribute = "moerl.policy_version"
	// DefaultUpdatingAttribute is the endpoint attribute that is > 0.5 while a weight update runs.
	DefaultUpdatingAttribute = "moerl.weight_update_in_progress"
	// DefaultAffinityHeader carries the GRPO group id or session id.
	DefaultAffinityHeader = "x-moerl-affinity-key"
)

// Config is the plugin's parameters block: the formula's parameters plus
// where to read the RL signals from.
type Config struct {
	rlscorer.Params
	// PrefixMatchInfoProducerName names the prefix producer instance ("" = default).
	PrefixMatchInfoProducerName string `json:"prefixMatchInfoProducerName,omitempty"`
	PolicyVersionAttribute      string `json:"policyVersionAttribute,omitempty"`
	UpdatingAttribute           string `json:"updatingAttribute,omitempty"`
	// AffinityHeaders are tried in order; the first present one is the key.
	AffinityHeaders []string `json:"affinityHeaders,omitempty"`
}

// DefaultConfig returns the defaults used for any omitted parameter.
func DefaultConfig() Config {
	return Config{
		Params:                 rlscorer.DefaultParams(),
		PolicyVersionAttribute: DefaultPolicyVersionAttribute,
		UpdatingAttribute:      DefaultUpdatingAttribute,
		AffinityHeaders:        []string{DefaultAffinityHeader},
	}
}

// ParseConfig decodes parameters strictly over DefaultConfig.
func ParseConfig(dec *json.Decoder) (Config, error) {
	cfg := DefaultConfig()
	if dec != nil {
		if err := dec.Decode(&cfg); err != nil {
			return cfg, fmt.Errorf("%s parameters: %w", ScorerType, err)
		}
	}
	return cfg, cfg.Params.Validate()
}

// Scorer is the moerl-rl-scorer plugin.
type Scorer struct {
	typedName plugin.TypedName
	cfg       Config
	prefixKey plugin.DataKey
	inFlight  *inFlight
}

var (
	_ fwksched.Scorer                      = &Scorer{}
	_ plugin.ConsumerPlugin                = &Scorer{}
	_ requestcontrol.PreRequest            = &Scorer{}
	_ requestcontrol.ResponseBodyProcessor = &Scorer{}
	_ fwksched.Filter                      = &PausedFilter{}
)

// NewScorer builds a scorer from a parsed config.
func NewScorer(name string, cfg Config) *Scorer {
	if name == "" {
		name = ScorerType
	}
	for i, h := range cfg.AffinityHeaders {
		cfg.AffinityHeaders[i] = strings.ToLower(h)
	}
	return &Scorer{
		typedName: plugin.TypedName{Type: ScorerType, Name: name},
		cfg:       cfg,
		prefixKey: attrprefix.PrefixCacheMatchInfoDataKey.WithNonEmptyProducerName(cfg.PrefixMatchInfoProducerName),
		inFlight:  newInFlight(),
	}
}

// ScorerFactory is the plugin.FactoryFunc registered for ScorerType.
func ScorerFactory(name string, dec *json.Decoder, _ plugin.Handle) (plugin.Plugin, error) {
	cfg, err := ParseConfig(dec)
	if err != nil {
		return nil, err
	}
	return NewScorer(name, cfg), nil
}

// TypedName implements plugin.Plugin.
func (s *Scorer) TypedName() plugin.TypedName { return s.typedName }

// Category is Balance: the formula mixes affinity (prefix, group home) with
// distribution (load, queue, bounded loads).
func (s *Scorer) Category() fwksched.ScorerCategory { return fwksched.Balance }

// Consumes declares the prefix match info as optional: without a prefix
// producer the prefix component is simply 0.
func (s *Scorer) Consumes() plugin.DataDependencies {
	return plugin.DataDependencies{Optional: map[plugin.DataKey]any{s.prefixKey: attrprefix.PrefixCacheMatchInfo{}}}
}

// endpointKey names an endpoint the same way in Score and in the request
// hooks (llm-d clones endpoints per request, so the value itself cannot be a key).
func endpointKey(md *datalayer.EndpointMetadata) string {
	if md == nil {
		return ""
	}
	return md.Address + ":" + md.Port
}

// Signals extracts the formula's inputs from an llm-d endpoint for a prompt of
// promptTokens tokens (0: unknown).
func (s *Scorer) Signals(ep fwksched.Endpoint, promptTokens int) rlscorer.Signals {
	sig := rlscorer.Signals{}
	if md := ep.GetMetadata(); md != nil {
		key := endpointKey(md)
		sig.Name = md.Name
		if sig.Name == "" {
			sig.Name = key
		}
		sig.InFlight = s.inFlight.get(key)
	}
	if m := ep.GetMetrics(); m != nil {
		sig.Waiting, sig.KVUsage = m.WaitingQueueSize, m.KVCacheUsagePercent
	}
	if raw, ok := ep.Get(s.prefixKey.String()); ok {
		if info, ok := raw.(*attrprefix.PrefixCacheMatchInfo); ok {
			sig.PrefixMatch = rlscorer.PrefixMatch(info.CachedBlockCount(), info.TotalBlocks(), promptTokens,
				info.BlockSizeTokens())
		}
	}
	if v, ok := attrmetrics.ReadScalarMetricValue(ep, s.cfg.PolicyVersionAttribute); ok {
		sig.PolicyVersion = int(v)
	}
	if v, ok := attrmetrics.ReadScalarMetricValue(ep, s.cfg.UpdatingAttribute); ok {
		sig.Updating = v > 0.5
	}
	return sig
}

// AffinityKey returns the request's group/session key, if any.
func (s *Scorer) AffinityKey(req *fwksched.InferenceRequest) (string, bool) {
	if req == nil {
		return "", false
	}
	for _, h := range s.cfg.AffinityHeaders {
		for k, v := range req.Headers {
			if v != "" && strings.ToLower(k) == h {
				return v, true
			}
		}
	}
	return "", false
}

// promptTokens is the request's prompt length in tokens as llm-d's token
// producer saw it (0 when it did not run).
func promptTokens(req *fwksched.InferenceRequest) int {
	if req == nil || req.Body == nil || req.Body.TokenizedPrompt == nil {
		return 0
	}
	return req.Body.TokenizedPrompt.TokenCount()
}

// Score implements fwksched.Scorer with the normalised formula total.
func (s *Scorer) Score(_ context.Context, req *fwksched.InferenceRequest, eps []fwksched.Endpoint) map[fwksched.Endpoint]float64 {
	sigs := make([]rlscorer.Signals, len(eps))
	n := promptTokens(req)
	for i, ep := range eps {
		sigs[i] = s.Signals(ep, n)
	}
	key, hasKey := s.AffinityKey(req)
	res := rlscorer.Score(sigs, key, hasKey, s.cfg.Params, false)
	out := make(map[fwksched.Endpoint]float64, len(eps))
	for i, ep := range eps {
		out[ep] = res.Normalized[i]
	}
	return out
}

// PreRequest implements requestcontrol.PreRequest: the request goes to the
// primary profile's first target and counts as in flight there.
func (s *Scorer) PreRequest(_ context.Context, req *fwksched.InferenceRequest, res *fwksched.SchedulingResult) error {
	if req == nil || res == nil {
		return nil
	}
	if pr := res.ProfileResults[res.PrimaryProfileName]; pr != nil && len(pr.TargetEndpoints) > 0 {
		s.inFlight.start(req.RequestID, endpointKey(pr.TargetEndpoints[0].GetMetadata()))
	}
	return nil
}

// ResponseBody implements requestcontrol.ResponseBodyProcessor: the end of
// the response stream ends the request's count.
func (s *Scorer) ResponseBody(_ context.Context, req *fwksched.InferenceRequest, resp *requestcontrol.Response,
	_ *datalayer.EndpointMetadata) {
	if req != nil && resp != nil && resp.EndOfStream {
		s.inFlight.finish(req.RequestID)
	}
}

// PausedFilter is the moerl-paused-filter plugin.
type PausedFilter struct {
	typedName plugin.TypedName
	attr      string
}

type filterConfig struct {
	UpdatingAttribute string `json:"updatingAttribute,omitempty"`
}

// FilterFactory is the plugin.FactoryFunc registered for FilterType.
func FilterFactory(name string, dec *json.Decoder, _ plugin.Handle) (plugin.Plugin, error) {
	cfg := filterConfig{UpdatingAttribute: DefaultUpdatingAttribute}
	if dec != nil {
		if err := dec.Decode(&cfg); err != nil {
			return nil, fmt.Errorf("%s parameters: %w", FilterType, err)
		}
	}
	if name == "" {
		name = FilterType
	}
	return &PausedFilter{typedName: plugin.TypedName{Type: FilterType, Name: name}, attr: cfg.UpdatingAttribute}, nil
}

// TypedName implements plugin.Plugin.
func (f *PausedFilter) TypedName() plugin.TypedName { return f.typedName }

// Filter keeps endpoints not in a weight update. With every endpoint paused
// it returns none, so the request fails fast instead of hanging on a paused
// replica: llm-d answers 429 (ResourceExhausted, "failed to find target
// endpoint"), and rl_loop's llm-d client backs off and asks again.
func (f *PausedFilter) Filter(_ context.Context, _ *fwksched.InferenceRequest, eps []fwksched.Endpoint) []fwksched.Endpoint {
	out := make([]fwksched.Endpoint, 0, len(eps))
	for _, ep := range eps {
		if v, ok := attrmetrics.ReadScalarMetricValue(ep, f.attr); ok && v > 0.5 {
			continue
		}
		out = append(out, ep)
	}
	return out
}

// Register adds both plugin types to llm-d's plugin registry; call it before
// the runner parses its configuration.
func Register() {
	plugin.Register(ScorerType, plugin.StabilityAlpha, ScorerFactory)
	plugin.Register(FilterType, plugin.StabilityAlpha, FilterFactory)
}

// decoder is a helper for tests and callers holding raw JSON parameters.
func decoder(raw []byte) *json.Decoder {
	if len(bytes.TrimSpace(raw)) == 0 {
		return nil
	}
	return plugin.StrictDecoder(raw)
}
