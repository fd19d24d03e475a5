package rlscorer

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// ParseParams decodes moerl-rl-scorer parameters over DefaultParams, rejecting
// unknown fields (a misspelt weight would otherwise silently keep its default)
// and invalid values.
func ParseParams(raw []byte) (Params, error) {
	p := DefaultParams()
	if len(bytes.TrimSpace(raw)) > 0 {
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			return p, fmt.Errorf("moerl-rl-scorer parameters: %w", err)
		}
	}
	return p, p.Validate()
}
