// SPDX-License-Identifier: Apache-2.0
#include "io/hf_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "config/hf_config.h"
#include "io/run_output.h"

namespace rp::core {
namespace {

namespace fs = std::filesystem;

}  // namespace

StatusOr<HfWeights> HfWeights::Open(const std::string& dir) {
  HfWeights w;
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> files;
  std::error_code ec;
  if (fs::exists(single, ec)) {
    files.push_back(single.string());
  } else if (fs::exists(index, ec)) {
    RP_ASSIGN_OR_RETURN(auto j, ReadJsonObject(index.string()));
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      return Status::InvalidArgument(index.string() + ": no weight_map object");
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) return Status::InvalidArgument(index.string() + ": weight_map value is not a file name");
      const std::string f = it.value().get<std::string>();
      if (f.find('/') != std::string::npos || f.find("..") != std::string::npos)
        return Status::InvalidArgument(index.string() + ": shard name \"" + f + "\" is not a plain file name");
      if (std::find(files.begin(), files.end(), (fs::path(dir) / f).string()) == files.end())
        files.push_back((fs::path(dir) / f).string());
    }
  } else {
    return Status::InvalidArgument("model.path: " + dir + " has neither model.safetensors nor model.safetensors.index.json");
  }
  for (const auto& f : files) {
    RP_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(f));
    w.files_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
    for (const auto& t : w.files_.back()->tensors()) {
      if (w.where_.count(t.name)) return Status::InvalidArgument(f + ": tensor \"" + t.name + "\" also appears in another shard");
      w.where_[t.name] = w.files_.back().get();
    }
  }
  return w;
}

Status HfWeights::Check(const ParamSpec& p) const {
  auto it = where_.find(p.name);
  if (it == where_.end()) return Status::InvalidArgument("model.path: no tensor \"" + p.name + "\" in the checkpoint");
  const SafetensorInfo* t = it->second->Find(p.name);
  if (t->shape != p.shape) {
    std::string got, want;
    for (auto d : t->shape) got += std::to_string(d) + " ";
    for (auto d : p.shape) want += std::to_string(d) + " ";
    return Status::InvalidArgument(it->second->path() + ": tensor \"" + p.name + "\" has shape [ " + got +
                                   "], the model needs [ " + want + "]");
  }
  return Status::Ok();
}

Status HfWeights::Load(const ParamSpec& p, float* out) const {
  RP_RETURN_IF_ERROR(Check(p));
  const SafetensorsFile* file = where_.at(p.name);
  return file->ReadAsFloat(*file->Find(p.name), out);
}

Status ExportHf(const std::string& dir, const ModelConfig& m, const ModelSpec& spec,
                const std::function<const float*(int)>& master, uint64_t shard_bytes) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IoError("export directory " + dir + ": " + ec.message());
  RP_ASSIGN_OR_RETURN(nlohmann::ordered_json c, HfConfigJson(m));
  RP_RETURN_IF_ERROR(WriteFileAtomically((fs::path(dir) / "config.json").string(), c.dump(2) + "\n"));
  // Shards: consecutive tensors while they fit the limit.
  std::vector<std::vector<SafetensorToWrite>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (size_t p = 0; p < spec.params.size(); ++p) {
    const auto& ps = spec.params[p];
    const uint64_t bytes = static_cast<uint64_t>(ps.numel) * 4;
    if (shard_bytes > 0 && in_shard > 0 && in_shard + bytes > shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back({ps.name, "F32", ps.shape, master(static_cast<int>(p)), bytes});
    in_shard += bytes;
    total += bytes;
  }
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  auto is_shard = [](const fs::path& f) {
    const std::string n = f.filename().string();
    return n.rfind("model-", 0) == 0 && n.find("-of-") != std::string::npos &&
           n.size() > 12 && n.substr(n.size() - 12) == ".safetensors";
  };
  std::vector<fs::path> written;
  if (shards.size() == 1) {
    RP_RETURN_IF_ERROR(WriteSafetensors(single.string(), shards[0], {{"format", "pt"}}));
    written.push_back(single);
  } else {
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    char name[64];
    for (size_t i = 0; i < shards.size(); ++i) {
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      RP_RETURN_IF_ERROR(WriteSafetensors((fs::path(dir) / name).string(), shards[i], {{"format", "pt"}}));
      written.push_back(fs::path(dir) / name);
      for (const auto& t : shards[i]) map[t.name] = name;
    }
    nlohmann::ordered_json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
    RP_RETURN_IF_ERROR(WriteFileAtomically(index.string(), idx.dump(2) + "\n"));
    written.push_back(index);
  }
  // Only now, with the new export complete: drop an earlier export's files of the other layout
  // (or a shard count that no longer applies).
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const fs::path f = e.path();
    const bool ours = f == single || f == index || is_shard(f);
    if (ours && std::find(written.begin(), written.end(), f) == written.end()) fs::remove(f, ec);
  }
  return Status::Ok();
}

}  // namespace rp::core
