// Command alloc runs kube-scheduler's own allocator
// (k8s.io/dynamic-resource-allocation/structured, the version it is built
// against) over a sequence of ResourceClaims on one node, as the scheduler
// does: each claim is allocated against the state of the claims before it,
// and that state is rebuilt from their allocation results as kube-scheduler's
// DynamicResources plugin rebuilds it (pkg/scheduler/framework/plugins/
// dynamicresources/allocateddevices.go, foreachAllocatedDevice: a result
// with adminAccess is not counted; with DRAConsumableCapacity on, a result
// with a shareID counts as a shared device and its consumedCapacity is
// aggregated; every other result is a dedicated device).
//
// carve's e2e suite (e2e/tests/upstream_allocator.rs) builds it once per
// release (e2e/upstream/build.sh) and feeds it carve's slices. It only
// drives the upstream code: it decides nothing itself.
//
// Input (stdin, JSON):
//
//	{"node": "name", "features": ["PartitionableDevices", ...],
//	 "slices": [ResourceSlice...], "classes": [DeviceClass...],
//	 "claims": [ResourceClaim...]}
//
// "features" are names of the fields of structured.Features of the release
// to turn on (a name the release does not have is an error). A field of
// the input that this release's k8s.io/api does not know is an error too:
// that release's API server would not have kept it. Output
// (stdout, JSON): one entry per claim, in order, with the allocation result
// the allocator returned, or none and why.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

type input struct {
	Node     string                       `json:"node"`
	Features []string                     `json:"features"`
	Slices   []*resourceapi.ResourceSlice `json:"slices"`
	Classes  []*resourceapi.DeviceClass   `json:"classes"`
	Claims   []*resourceapi.ResourceClaim `json:"claims"`
}

type outcome struct {
	Claim      string                        `json:"claim"`
	Allocation *resourceapi.AllocationResult `json:"allocation,omitempty"`
	// Unsatisfiable: the allocator found no allocation (a nil result, or
	// an error it marks as a failed allocation on this node).
	Unsatisfiable bool   `json:"unsatisfiable,omitempty"`
	Error         string `json:"error,omitempty"`
}

type output struct {
	// The structured.Features fields this release has, sorted.
	Features []string  `json:"features"`
	Results  []outcome `json:"results"`
}

type classes []*resourceapi.DeviceClass

func (c classes) List() ([]*resourceapi.DeviceClass, error) { return c, nil }

func (c classes) Get(name string) (*resourceapi.DeviceClass, error) {
	for _, class := range c {
		if class.Name == name {
			return class, nil
		}
	}
	return nil, fmt.Errorf("deviceclass %q not found", name)
}

// setBool sets the bool field `name` of the struct *ptr; false if it has none.
func setBool(ptr any, name string) bool {
	f := reflect.ValueOf(ptr).Elem().FieldByName(name)
	if !f.IsValid() || f.Kind() != reflect.Bool {
		return false
	}
	f.SetBool(true)
	return true
}

func fieldNames(v any) []string {
	t := reflect.TypeOf(v)
	var names []string
	for i := 0; i < t.NumField(); i++ {
		if t.Field(i).Type.Kind() == reflect.Bool {
			names = append(names, t.Field(i).Name)
		}
	}
	sort.Strings(names)
	return names
}

// state rebuilds the allocated state from claims already allocated, as
// foreachAllocatedDevice does with DRAConsumableCapacity on or off.
func state(allocated []*resourceapi.ResourceClaim, consumable bool) structured.AllocatedState {
	s := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, claim := range allocated {
		for _, r := range claim.Status.Allocation.Devices.Results {
			if ptr.Deref(r.AdminAccess, false) {
				continue
			}
			id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
			if consumable && r.ShareID != nil {
				s.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
				if r.ConsumedCapacity != nil {
					s.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, r.ConsumedCapacity))
				}
				continue
			}
			s.AllocatedDevices.Insert(id)
		}
	}
	return s
}

func run() error {
	var in input
	dec := json.NewDecoder(os.Stdin)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil {
		return fmt.Errorf("reading the input: %w", err)
	}
	var features structured.Features
	consumable := false
	for _, name := range in.Features {
		if !setBool(&features, name) {
			return fmt.Errorf("this release's structured.Features has no field %q (it has %s)",
				name, strings.Join(fieldNames(features), ", "))
		}
		if name == "ConsumableCapacity" {
			consumable = true
		}
	}
	var celFeatures cel.Features
	if consumable {
		setBool(&celFeatures, "EnableConsumableCapacity")
	}
	if contains(in.Features, "ListTypeAttributes") {
		setBool(&celFeatures, "EnableListTypeAttributes")
	}
	celCache := cel.NewCache(100, celFeatures)
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{
		Name:   in.Node,
		Labels: map[string]string{"kubernetes.io/hostname": in.Node},
	}}
	ctx := context.Background()
	out := output{Features: fieldNames(features), Results: []outcome{}}
	var allocated []*resourceapi.ResourceClaim
	for _, claim := range in.Claims {
		o := outcome{Claim: claim.Namespace + "/" + claim.Name}
		alloc, err := structured.NewAllocator(ctx, features, state(allocated, consumable),
			classes(in.Classes), in.Slices, celCache)
		if err != nil {
			return fmt.Errorf("NewAllocator: %w", err)
		}
		results, err := alloc.Allocate(ctx, node, []*resourceapi.ResourceClaim{claim})
		switch {
		case err != nil && isFailedAllocation(err):
			o.Unsatisfiable = true
			o.Error = err.Error()
		case err != nil:
			o.Error = err.Error()
		case len(results) == 0:
			o.Unsatisfiable = true
		default:
			o.Allocation = &results[0]
			c := claim.DeepCopy()
			c.Status.Allocation = &results[0]
			allocated = append(allocated, c)
		}
		out.Results = append(out.Results, o)
	}
	enc := json.NewEncoder(os.Stdout)
	return enc.Encode(out)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "alloc:", err)
		os.Exit(1)
	}
}
