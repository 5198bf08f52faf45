// Command etcd is the etcd server of carve's real-cluster suite: the main of
// go.etcd.io/etcd/server/v3 (etcdmain.Main), built from its module in a
// wrapper because the server module's own replace directives keep `go
// install` from building it directly.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
