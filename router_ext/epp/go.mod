module github.com/moerl/moerl/router_ext/epp

go 1.26
