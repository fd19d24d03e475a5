// Command moerl-epp is llm-d-router v0.10.0's endpoint picker with moerl's
// plugins (moerl-rl-scorer, moerl-paused-filter) compiled in next to all of
// llm-d's own. It takes llm-d's flags unchanged; moerl router-config writes a
// matching --config-file for standalone (file discovery) mode.
package main

import (
	"os"

	ctrl "sigs.k8s.io/controller-runtime"

	"github.com/llm-d/llm-d-router/cmd/epp/runner"

	"github.com/moerl/moerl/router_ext/epp/picker/rlplugin"
)

func main() {
	rlplugin.Register()
	ctx := ctrl.SetupSignalHandler()
	if err := runner.NewRunner().WithExecutableName("moerl-epp").Run(ctx); err != nil {
		os.Exit(1)
	}
}
