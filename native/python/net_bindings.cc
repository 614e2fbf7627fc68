// Bindings of the data plane: the DataServer a shard serves on and the
// Client that pulls, pushes and assigns rows over TCP.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "native/core/shard.h"
#include "native/net/client.h"
#include "native/net/data_server.h"
#include "native/net/frame_call.h"
#include "native/net/replica_group.h"
#include "native/net/replicator.h"
#include "native/net/socket.h"
#include "native/python/bindings.h"

namespace dlt {
namespace {

py::dict StatusToDict(const ReplicationStatus& s) {
  py::dict d;
  d["standby"] = s.standby;
  d["connected"] = s.connected;
  d["caught_up"] = s.caught_up;
  d["rounds"] = s.rounds;
  d["rows_sent"] = s.rows_sent;
  d["removals_sent"] = s.removals_sent;
  d["tables_copied"] = s.tables_copied;
  d["connects"] = s.connects;
  d["lag_seconds"] = s.lag_seconds;
  d["down_seconds"] = s.down_seconds;
  d["error"] = s.error;
  d["first_bucket"] = s.first_bucket;
  d["end_bucket"] = s.end_bucket;
  d["ended"] = s.ended;
  return d;
}

py::dict ViewToDict(const wire::InSyncView& v) {
  py::dict d;
  d["epoch"] = v.epoch;
  d["version"] = v.version;
  d["members"] = v.members;
  return d;
}

ReplicatorOptions Options(const std::string& auth_token, bool sync, int io_timeout_ms,
                          int interval_ms, int write_timeout_ms) {
  if (io_timeout_ms <= 0 || interval_ms <= 0 || write_timeout_ms <= 0) {
    Raise(InvalidArgument("io_timeout_ms, interval_ms and write_timeout_ms must be positive"));
  }
  ReplicatorOptions o;
  o.auth_token = auth_token;
  o.sync = sync;
  o.io_timeout_ms = io_timeout_ms;
  o.write_timeout_ms = write_timeout_ms;
  o.interval_ms = interval_ms;
  return o;
}

}  // namespace

void BindNet(py::module_& m) {
  py::class_<DataServer>(m, "DataServer")
      .def(py::init([](std::shared_ptr<Shard> shard, const std::string& bind, int port,
                       int max_connections, const std::string& auth_token, uint32_t max_frame_bytes,
                       uint32_t admin_port, int io_timeout_ms, int worker_threads,
                       int max_unauthenticated, int hello_timeout_ms, int idle_timeout_ms,
                       uint64_t max_buffered_bytes, int other_fds) {
             DataServerOptions o;
             o.bind = bind;
             o.port = port;
             o.max_connections = max_connections;
             o.auth_token = auth_token;
             o.max_frame_bytes = max_frame_bytes;
             o.admin_port = admin_port;
             o.io_timeout_ms = io_timeout_ms;
             o.worker_threads = worker_threads;
             o.max_unauthenticated = max_unauthenticated;
             o.hello_timeout_ms = hello_timeout_ms;
             o.idle_timeout_ms = idle_timeout_ms;
             o.max_buffered_bytes = max_buffered_bytes;
             o.other_fds = other_fds;
             return std::make_unique<DataServer>(std::move(shard), o);
           }),
           py::arg("shard").none(false), py::arg("bind") = "127.0.0.1", py::arg("port") = 0,
           py::arg("max_connections") = 0, py::arg("auth_token") = "",
           py::arg("max_frame_bytes") = wire::kDefaultMaxFrameBytes, py::arg("admin_port") = 0,
           py::arg("io_timeout_ms") = 30000, py::arg("worker_threads") = 0,
           py::arg("max_unauthenticated") = 256, py::arg("hello_timeout_ms") = 5000,
           py::arg("idle_timeout_ms") = 600000, py::arg("max_buffered_bytes") = uint64_t{1} << 30,
           py::arg("other_fds") = 256)
      .def("start", [](DataServer& s) { Check(s.Start()); })
      .def("set_read_only", &DataServer::set_read_only)
      .def("set_standby", &DataServer::set_standby, py::arg("standby"), py::arg("new_epoch") = true)
      .def("set_standbys", &DataServer::set_standbys)
      .def_property_readonly("standby", &DataServer::standby)
      .def_property_readonly("standby_caught_up", &DataServer::standby_caught_up)
      .def(
          "set_replica_group",
          [](DataServer& s, std::shared_ptr<ReplicaGroup> group) {
            s.set_write_listener(std::move(group));
          },
          py::arg("group").none(true))
      .def_property_readonly("insync_view",
                             [](const DataServer& s) { return ViewToDict(s.insync_view()); })
      .def_property_readonly("port", &DataServer::port)
      .def_property_readonly("max_connections", &DataServer::max_connections)
      .def_property_readonly("worker_threads", &DataServer::worker_threads)
      .def("set_admin_port", &DataServer::set_admin_port)
      // Live re-sharding (docs/replication.md).
      .def(
          "reshard_prepare",
          [](DataServer& s, uint32_t shard_index, uint32_t num_shards) {
            Check(Shard::CheckPlace(shard_index, num_shards));
            return s.reshard_target().Prepare(std::make_shared<Shard>(shard_index, num_shards));
          },
          py::arg("shard_index"), py::arg("num_shards"))
      .def("reshard_clear", [](DataServer& s) { s.reshard_target().Clear(); })
      .def_property_readonly(
          "reshard_prepared",
          [](DataServer& s) {
            const std::shared_ptr<Shard> next = s.reshard_target().next();
            return next == nullptr
                       ? py::object(py::none())
                       : py::object(py::make_tuple(next->shard_index(), next->num_shards()));
          })
      .def(
          "hold_writes",
          [](DataServer& s, bool hold, int timeout_ms) {
            CheckWithoutGil([&] { return s.HoldWrites(hold, timeout_ms); });
          },
          py::arg("hold"), py::arg("timeout_ms") = 10000)
      .def(
          "switch_layout",
          [](DataServer& s, uint64_t layout_epoch, const std::string& addresses) {
            CheckWithoutGil([&] { return s.SwitchLayout(layout_epoch, addresses); });
          },
          py::arg("layout_epoch"), py::arg("addresses"))
      .def("revert_layout", &DataServer::RevertLayout, py::arg("layout_epoch"),
           py::arg("addresses"), py::call_guard<GilRelease>())
      .def("stop", &DataServer::Stop, py::call_guard<GilRelease>())
      .def("counters", [](const DataServer& s) { return CountersToDict(s.counters()); });

  m.def(
      "hello",
      [](const std::string& address, const std::string& auth_token, int timeout_ms, bool replica) {
        wire::HelloReply reply;
        Status s;
        {
          GilRelease release;
          const auto deadline = net::Clock::now() + std::chrono::milliseconds(timeout_ms);
          int fd = -1;
          s = net::Connect(address, deadline, &fd);
          if (s.ok()) {
            s = net::SayHello(fd, auth_token,
                              wire::kFlagTopology | (replica ? wire::kFlagReplica : 0), 0, deadline,
                              &reply);
            net::CloseFd(fd);
          }
        }
        Check(s.WithContext(address + " Hello"));
        py::dict d;
        d["shard_index"] = reply.shard_index;
        d["num_shards"] = reply.num_shards;
        d["admin_port"] = reply.admin_port;
        d["max_frame_bytes"] = reply.max_frame_bytes;
        d["epoch"] = reply.epoch;
        d["standbys"] = reply.standbys;
        d["layout_epoch"] = reply.layout_epoch;
        d["layout"] = reply.layout;
        d["lineage"] = reply.lineage;
        return d;
      },
      py::arg("address"), py::arg("auth_token") = "", py::arg("timeout_ms") = 5000,
      py::arg("replica") = false,
      "One Hello to one shard server, whichever shard it is: what it said. With `replica`, "
      "the Hello a primary's replicator says: only a standby answers it.");

  py::class_<Replicator, std::shared_ptr<Replicator>>(m, "Replicator")
      .def(py::init([](std::shared_ptr<Shard> shard, const std::string& standby,
                       const std::string& auth_token, bool sync, int io_timeout_ms, int interval_ms,
                       bool range_stream, double copy_pace, int write_timeout_ms) {
             if (!(copy_pace > 0 && copy_pace <= 1)) {
               Raise(InvalidArgument("copy_pace must be in (0, 1], got " +
                                     std::to_string(copy_pace)));
             }
             ReplicatorOptions o = Options(auth_token, sync && !range_stream, io_timeout_ms,
                                           interval_ms, write_timeout_ms);
             o.range_stream = range_stream;
             o.copy_pace = copy_pace;
             return std::make_shared<Replicator>(std::move(shard), standby, o);
           }),
           py::arg("shard").none(false), py::arg("standby"), py::arg("auth_token") = "",
           py::arg("sync") = true, py::arg("io_timeout_ms") = 30000, py::arg("interval_ms") = 10,
           py::arg("range_stream") = false, py::arg("copy_pace") = 1.0,
           py::arg("write_timeout_ms") = 10000)
      .def("start", &Replicator::Start)
      .def("stop", &Replicator::Stop, py::call_guard<GilRelease>())
      .def(
          "pause",
          [](Replicator& r, bool pause) { CheckWithoutGil([&] { return r.Pause(pause); }); },
          py::arg("pause"))
      .def("status", [](const Replicator& r) { return StatusToDict(r.status()); });

  py::class_<ReplicaGroup, std::shared_ptr<ReplicaGroup>>(m, "ReplicaGroup")
      .def(py::init([](std::shared_ptr<Shard> shard, const std::string& auth_token, bool sync,
                       int io_timeout_ms, int interval_ms, int detach_after_ms,
                       int write_timeout_ms) {
             if (detach_after_ms <= 0) Raise(InvalidArgument("detach_after_ms must be positive"));
             return std::make_shared<ReplicaGroup>(
                 std::move(shard),
                 Options(auth_token, sync, io_timeout_ms, interval_ms, write_timeout_ms),
                 detach_after_ms);
           }),
           py::arg("shard").none(false), py::arg("auth_token") = "", py::arg("sync") = true,
           py::arg("io_timeout_ms") = 30000, py::arg("interval_ms") = 10,
           py::arg("detach_after_ms") = 60000, py::arg("write_timeout_ms") = 10000)
      .def("attach",
           [](ReplicaGroup& g, const std::string& address) {
             // Without the GIL: a replaced replicator stops first.
             CheckWithoutGil([&] { return g.Attach(address); });
           })
      .def("detach", &ReplicaGroup::Detach, py::call_guard<GilRelease>())
      .def("stop", &ReplicaGroup::Stop, py::call_guard<GilRelease>())
      .def(
          "pause",
          [](ReplicaGroup& g, bool pause) { CheckWithoutGil([&] { return g.Pause(pause); }); },
          py::arg("pause"))
      .def(
          "hold",
          [](ReplicaGroup& g, int timeout_ms) {
            CheckWithoutGil([&] { return g.Hold(timeout_ms); });
          },
          py::arg("timeout_ms"))
      .def("addresses", &ReplicaGroup::addresses)
      .def("view", [](const ReplicaGroup& g) { return ViewToDict(g.view()); })
      .def("statuses", [](const ReplicaGroup& g) {
        py::list out;
        for (const ReplicationStatus& s : g.statuses()) out.append(StatusToDict(s));
        return out;
      });

  py::class_<Client>(m, "Client")
      .def(py::init([](std::vector<std::string> addresses, const std::string& auth_token,
                       int connect_timeout_ms, int request_timeout_ms, uint32_t frame_bytes,
                       int max_idle_connections) {
             if (addresses.empty()) Raise(InvalidArgument("at least one shard address is needed"));
             if (connect_timeout_ms <= 0 || request_timeout_ms <= 0) {
               Raise(InvalidArgument("timeouts must be positive"));
             }
             if (frame_bytes < wire::kMinMaxFrameBytes) {
               Raise(InvalidArgument("frame_bytes must be at least 4096"));
             }
             ClientOptions o;
             o.auth_token = auth_token;
             o.connect_timeout_ms = connect_timeout_ms;
             o.request_timeout_ms = request_timeout_ms;
             o.frame_bytes = frame_bytes;
             o.max_idle_connections = max_idle_connections;
             return std::make_unique<Client>(std::move(addresses), o);
           }),
           py::arg("addresses"), py::arg("auth_token") = "", py::arg("connect_timeout_ms") = 5000,
           py::arg("request_timeout_ms") = 30000, py::arg("frame_bytes") = 8u << 20,
           py::arg("max_idle_connections") = 8)
      .def_property_readonly("num_shards", &Client::num_shards)
      .def_property_readonly("layout_epoch", &Client::layout_epoch)
      .def(
          "learn_layout",
          [](Client& c) {
            GilRelease release;
            return c.LearnNewerLayout();
          },
          "Asks the shards for their layout and routes by a newer one from now on; True when "
          "the layout changed.")
      .def("close_idle", &Client::CloseIdle, py::call_guard<GilRelease>(),
           "Closes every pooled connection now; a later call connects again.")
      .def(
          "regreet",
          [](Client& c) {
            Status s;
            {
              GilRelease release;
              s = c.Regreet();
            }
            Check(s);
          },
          "Greets every shard again as a new client would (the newest copy its addresses serve, "
          "of whatever lineage), forgetting the copies met before.")
      .def("shard_infos",
           [](Client& c) {
             std::vector<ShardInfo> infos;
             Status s;
             {
               GilRelease release;
               s = c.GetShardInfos(&infos);
             }
             Check(s);
             py::list out;
             for (const ShardInfo& i : infos) {
               py::dict d;
               d["address"] = i.address;
               d["replicas"] = i.replicas;
               d["shard_index"] = i.shard_index;
               d["num_shards"] = i.num_shards;
               d["admin_port"] = i.admin_port;
               d["max_frame_bytes"] = i.max_frame_bytes;
               d["lineage"] = i.lineage;
               d["epoch"] = i.epoch;
               out.append(d);
             }
             return out;
           })
      .def(
          "pull",
          [](Client& c, const std::string& table, uint32_t dim, const IdArray& ids, int mode) {
            CheckIds(ids);
            if (mode < 0 || mode > 2) Raise(InvalidArgument("pull mode must be 0, 1 or 2"));
            const size_t n = static_cast<size_t>(ids.shape(0));
            FloatArray out({n, static_cast<size_t>(dim)});
            Status s;
            {
              GilRelease release;
              s = c.Pull(table, dim, ids.data(), n, static_cast<PullMode>(mode),
                         out.mutable_data());
            }
            Check(s);
            return out;
          },
          py::arg("table"), py::arg("dim"), py::arg("ids"), py::arg("mode") = 0)
      .def(
          "pull_state",
          [](Client& c, const std::string& table, uint32_t dim, uint32_t slot_floats,
             const IdArray& ids, bool insert) {
            CheckIds(ids);
            const size_t n = static_cast<size_t>(ids.shape(0));
            FloatArray out({n, static_cast<size_t>(StateFloats(dim, slot_floats))});
            Status s;
            {
              GilRelease release;
              s = c.PullState(table, dim, slot_floats, ids.data(), n, out.mutable_data(), insert);
            }
            Check(s);
            return out;
          },
          py::arg("table"), py::arg("dim"), py::arg("slot_floats"), py::arg("ids"),
          py::arg("insert") = false,
          "Rows with their optimizer state (values, slots, step as a float), inserting none; "
          "with insert, an id with no row in RAM is pulled as a training pull pulls it.")
      .def("push",
           [](Client& c, const std::string& table, uint32_t dim, const IdArray& ids,
              const FloatArray& grads, float lr) {
             CheckIds(ids);
             const size_t n = static_cast<size_t>(ids.shape(0));
             CheckRows(grads, n, dim, "grads");
             Status s;
             {
               GilRelease release;
               s = c.Push(table, dim, ids.data(), grads.data(), n, lr);
             }
             Check(s);
           })
      .def("assign", [](Client& c, const std::string& table, uint32_t dim, const IdArray& ids,
                        const FloatArray& values) {
        CheckIds(ids);
        const size_t n = static_cast<size_t>(ids.shape(0));
        CheckRows(values, n, dim, "values");
        Status s;
        {
          GilRelease release;
          s = c.Assign(table, dim, ids.data(), values.data(), n);
        }
        Check(s);
      });
}

}  // namespace dlt
