// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "protocol/codec.h"

namespace rp::proto {
namespace {

TEST(Codec, RoundTripsEveryMessage) {
  Welcome w{};
  w.segment_bytes = 123;
  w.num_workers = 3;
  CopyText(w.segment_name, "rp-abc-state");
  JobFailed f{};
  f.job_index = 9;
  CopyText(f.message, "boom");
  std::vector<Message> all = {Hello{2, 1000, 0xabcdef, -1, 0},
                              w,
                              RunJob{17, 3, 1, 4, 1, 5, 0.25, 3, 1, 0},
                              InputReady{17, 2, 1, kFromHostSlot, 0},
                              MicrobatchDone{17, 2, kMicrobatchLayerMajor, 1.5, 64, 10, 20},
                              GradsReady{17},
                              CommitGrads{17, 1, 0},
                              JobDone{17, 1, 2, 3, 0.5, 4, 5},
                              f,
                              Shutdown{0, 0},
                              Heartbeat{123},
                              LinkProbe{5e10, 4e10, 1 << 20},
                              LayerTime{17, 2, 5, 2, 0, 0.001, 4096},
                              RunEval{40, 9, 10, 2, 0},
                              EvalDone{40, 123.5, 256, 5, 9},
                              ActivationPool{1, 0, 1 << 30, {}},
                              StepUpdate{3, 4, 1e-5, 0.5f, 0}};
  ASSERT_EQ(all.size(), static_cast<size_t>(kMaxMsgType - kMinMsgType + 1));
  for (const auto& m : all) {
    std::string frame = Encode(m);
    auto d = Decode(frame);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(TypeOfMessage(*d), TypeOfMessage(m));
    EXPECT_EQ(frame.size(), sizeof(FrameHeader) + PayloadBytes(TypeOfMessage(m)));
    EXPECT_EQ(Encode(*d), frame);
  }
  auto r = std::get<RunJob>(*Decode(Encode(all[2])));
  EXPECT_EQ(r.job_index, 17);
  EXPECT_EQ(r.stage, 4);
  EXPECT_DOUBLE_EQ(r.loss_scale, 0.25);
  EXPECT_STREQ(std::get<Welcome>(*Decode(Encode(w))).segment_name, "rp-abc-state");
}

TEST(Codec, RejectsMalformedFrames) {
  const std::string good = Encode(GradsReady{5});
  auto expect_bad = [](const std::string& frame, const char* needle) {
    auto d = Decode(frame);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), StatusCode::kProtocolError);
    EXPECT_NE(d.status().message().find(needle), std::string::npos) << d.status().message();
  };
  expect_bad("", "shorter than");
  expect_bad(good.substr(0, 10), "shorter than");
  std::string bad_magic = good;
  bad_magic[0] ^= 1;
  expect_bad(bad_magic, "magic");
  std::string bad_version = good;
  bad_version[4] = static_cast<char>(kProtocolVersion + 1);
  expect_bad(bad_version, "version");
  expect_bad(good + "x", "payload bytes");
  std::string bad_type = good;
  bad_type[6] = 99;
  expect_bad(bad_type, "unknown message type");
  // A payload of the wrong size for its type, with a consistent header.
  std::string wrong_size = Encode(InputReady{1, 2, kFromHostSlot, kFromHostSlot, 0});
  wrong_size[6] = static_cast<char>(MsgType::kJobDone);
  expect_bad(wrong_size, "expected 56");
  Welcome w{};
  std::memset(w.segment_name, 'a', sizeof(w.segment_name));
  expect_bad(Encode(w), "NUL");
  expect_bad(Encode(LayerTime{1, 0, 3, 7, 0, 0.5, -1}), "phase 7");
  expect_bad(Encode(MicrobatchDone{1, 0, kMicrobatchLayerMajor | 4u, 0.0, 0, 0, 0}),
             "unknown flags 5");
}

TEST(Codec, RandomBytesNeverCrash) {
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    std::string frame = Encode(RunJob{1, 2, 3, 4, 0, 5, 1.0, 2, 0, 0});
    if (i % 2) frame.resize(rng() % 80);
    for (int k = 0; k < 3; ++k)
      if (!frame.empty()) frame[rng() % frame.size()] = static_cast<char>(rng());
    auto d = Decode(frame);
    if (d.ok()) {
      EXPECT_EQ(Encode(*d).size(), frame.size());
    }
  }
}

}  // namespace
}  // namespace rp::proto
