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
      if (!it.value().is_string())
        return Status::InvalidArgument(index.string() + ": weight_map value is not a file name");
      const std::string f = it.value().get<std::string>();
      if (f.find('/') != std::string::npos || f.find("..") != std::string::npos)
        return Status::InvalidArgument(index.string() + ": shard name \"" + f +
                                       "\" is not a plain file name");
      if (std::find(files.begin(), files.end(), (fs::path(dir) / f).string()) == files.end())
        files.push_back((fs::path(dir) / f).string());
    }
  } else {
    return Status::InvalidArgument(
        "model.path: " + dir + " has neither model.safetensors nor model.safetensors.index.json");
  }
  for (const auto& f : files) {
    RP_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(f));
    w.files_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
    for (const auto& t : w.files_.back()->tensors()) {
      if (w.where_.count(t.name))
        return Status::InvalidArgument(f + ": tensor \"" + t.name +
                                       "\" also appears in another shard");
      w.where_[t.name] = w.files_.back().get();
    }
  }
  return w;
}

std::vector<ExpertPiece> ExpertPieces(const ParamSpec& p) {
  static const std::string kGateUp = ".mlp.experts.gate_up_proj", kDown = ".mlp.experts.down_proj";
  const bool gate_up = p.name.ends_with(kGateUp), down = p.name.ends_with(kDown);
  if ((!gate_up && !down) || p.shape.size() != 3) return {};
  const std::string pre =
      p.name.substr(0, p.name.size() - (gate_up ? kGateUp : kDown).size()) + ".mlp.experts.";
  const int64_t E = p.shape[0], rows = p.shape[1], cols = p.shape[2];
  std::vector<ExpertPiece> out;
  for (int64_t e = 0; e < E; ++e) {
    const std::string at = pre + std::to_string(e) + ".";
    if (gate_up) {  // [E, 2I, H]: gate's I rows, then up's
      out.push_back({at + "gate_proj.weight", {rows / 2, cols}, e * rows * cols});
      out.push_back({at + "up_proj.weight", {rows / 2, cols}, e * rows * cols + rows / 2 * cols});
    } else {
      out.push_back({at + "down_proj.weight", {rows, cols}, e * rows * cols});
    }
  }
  return out;
}

Status HfWeights::CheckTensor(const std::string& name, const std::vector<int64_t>& shape) const {
  auto it = where_.find(name);
  if (it == where_.end())
    return Status::InvalidArgument("model.path: no tensor \"" + name + "\" in the checkpoint");
  const SafetensorInfo* t = it->second->Find(name);
  if (t->shape != shape) {
    std::string got, want;
    for (auto d : t->shape) got += std::to_string(d) + " ";
    for (auto d : shape) want += std::to_string(d) + " ";
    return Status::InvalidArgument(it->second->path() + ": tensor \"" + name + "\" has shape [ " +
                                   got + "], the model needs [ " + want + "]");
  }
  return Status::Ok();
}

Status HfWeights::LoadTensor(const std::string& name, const std::vector<int64_t>& shape,
                             float* out) const {
  RP_RETURN_IF_ERROR(CheckTensor(name, shape));
  const SafetensorsFile* file = where_.at(name);
  return file->ReadAsFloat(*file->Find(name), out);
}

Status HfWeights::Check(const ParamSpec& p) const {
  const auto pieces = ExpertPieces(p);
  if (pieces.empty() || where_.count(p.name)) return CheckTensor(p.name, p.shape);
  for (const auto& piece : pieces) {
    Status s = CheckTensor(piece.name, piece.shape);
    if (!s.ok())
      return Status::InvalidArgument(s.message() + " (nor the fused \"" + p.name + "\")");
  }
  return Status::Ok();
}

Status HfWeights::Load(const ParamSpec& p, float* out) const {
  const auto pieces = ExpertPieces(p);
  if (pieces.empty() || where_.count(p.name)) return LoadTensor(p.name, p.shape, out);
  RP_RETURN_IF_ERROR(Check(p));
  for (const auto& piece : pieces)
    RP_RETURN_IF_ERROR(LoadTensor(piece.name, piece.shape, out + piece.offset));
  return Status::Ok();
}

Status CopyBaseFiles(const std::string& base_dir, const std::string& dir, bool generation) {
  static const char* const kTokenizerFiles[] = {"tokenizer.json",
                                                "tokenizer_config.json",
                                                "special_tokens_map.json",
                                                "tokenizer.model",
                                                "vocab.json",
                                                "merges.txt",
                                                "added_tokens.json",
                                                "chat_template.jinja",
                                                "chat_template.json"};
  std::vector<std::string> names(std::begin(kTokenizerFiles), std::end(kTokenizerFiles));
  if (generation) names.push_back("generation_config.json");
  for (const auto& name : names) {
    const fs::path from = fs::path(base_dir) / name;
    std::error_code ec;
    if (!fs::is_regular_file(from, ec)) continue;
    std::ifstream in(from, std::ios::binary);
    std::stringstream bytes;
    if (!(bytes << in.rdbuf()) && fs::file_size(from, ec) > 0)
      return Status::IoError("export: cannot read " + from.string());
    RP_RETURN_IF_ERROR(WriteFileAtomically((fs::path(dir) / name).string(), bytes.str()));
  }
  return Status::Ok();
}

Status ExportHf(const std::string& dir, const ModelConfig& m, const ModelSpec& spec,
                const std::function<const float*(int)>& master, const HfExport& how) {
  if (how.dtype == ExportDtype::kAuto)
    return Status::Internal("ExportHf: the export dtype reached it unresolved");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IoError("export directory " + dir + ": " + ec.message());
  RP_ASSIGN_OR_RETURN(nlohmann::ordered_json c, HfConfigJson(m));
  c["dtype"] = EnumName(how.dtype);
  c["torch_dtype"] = EnumName(how.dtype);
  if (!how.base_dir.empty()) {
    // The base's special tokens: generation stops where the base's would.
    std::ifstream base_config(fs::path(how.base_dir) / "config.json");
    const auto base = nlohmann::json::parse(base_config, nullptr, /*allow_exceptions=*/false);
    if (base.is_object())
      for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
        if (base.contains(key)) c[key] = base[key];
    RP_RETURN_IF_ERROR(CopyBaseFiles(how.base_dir, dir, /*generation=*/true));
  }
  RP_RETURN_IF_ERROR(
      WriteFileAtomically((fs::path(dir) / "config.json").string(), c.dump(2) + "\n"));
  // Shards: consecutive tensors while they fit the limit. Each tensor is one or more pieces (an
  // expert parameter is one tensor per expert and projection), converted a shard at a time.
  struct Piece {
    std::string name;
    std::vector<int64_t> shape;
    const float* values;
    int64_t numel;
  };
  const bool f32 = how.dtype == ExportDtype::kFloat32;
  const uint64_t elem = f32 ? 4 : 2;
  const char* dtype = f32 ? "F32" : how.dtype == ExportDtype::kBfloat16 ? "BF16" : "F16";
  std::vector<std::vector<Piece>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (size_t p = 0; p < spec.params.size(); ++p) {
    const auto& ps = spec.params[p];
    const uint64_t bytes = static_cast<uint64_t>(ps.numel) * elem;
    if (how.shard_bytes > 0 && in_shard > 0 && in_shard + bytes > how.shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    const float* values = master(static_cast<int>(p));
    const auto pieces = ExpertPieces(ps);
    if (pieces.empty()) {
      shards.back().push_back({ps.name, ps.shape, values, ps.numel});
    } else {
      for (const auto& piece : pieces)
        shards.back().push_back(
            {piece.name, piece.shape, values + piece.offset, piece.shape[0] * piece.shape[1]});
    }
    in_shard += bytes;
    total += bytes;
  }
  auto write_shard = [&](const std::string& path, const std::vector<Piece>& pieces) {
    std::vector<std::vector<uint16_t>> converted;
    std::vector<SafetensorToWrite> tensors;
    for (const auto& piece : pieces) {
      const uint64_t bytes = static_cast<uint64_t>(piece.numel) * elem;
      if (f32) {
        tensors.push_back({piece.name, dtype, piece.shape, piece.values, bytes});
        continue;
      }
      converted.emplace_back(static_cast<size_t>(piece.numel));
      if (how.dtype == ExportDtype::kBfloat16)
        FloatToBf16(piece.values, piece.numel, converted.back().data());
      else FloatToHalf(piece.values, piece.numel, converted.back().data());
      tensors.push_back({piece.name, dtype, piece.shape, converted.back().data(), bytes});
    }
    return WriteSafetensors(path, tensors, {{"format", "pt"}});
  };
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  auto is_shard = [](const fs::path& f) {
    const std::string n = f.filename().string();
    return n.rfind("model-", 0) == 0 && n.find("-of-") != std::string::npos && n.size() > 12 &&
           n.substr(n.size() - 12) == ".safetensors";
  };
  std::vector<fs::path> written;
  if (shards.size() == 1) {
    RP_RETURN_IF_ERROR(write_shard(single.string(), shards[0]));
    written.push_back(single);
  } else {
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    char name[64];
    for (size_t i = 0; i < shards.size(); ++i) {
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      RP_RETURN_IF_ERROR(write_shard((fs::path(dir) / name).string(), shards[i]));
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
