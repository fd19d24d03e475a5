// Package epp is the root of moerl's Go code for the llm-d router.
//
// This module (standard library only, so `go test ./...` runs anywhere Go
// runs) holds the scoring formula in package rlscorer, tested against the
// vectors shared with the Python implementation. The llm-d plugin adapter and
// the endpoint-picker binary live in the nested module ./picker, which needs
// github.com/llm-d/llm-d-router v0.10.0 (see picker/README.md).
package epp
