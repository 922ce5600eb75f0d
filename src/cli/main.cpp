// dspark: speculative decoding engine. Every failure a user can cause ends as
// one "error: ..." line on stderr and exit status 1 (2 for bad flags).
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"dspark: lossless speculative decoding with DSpark drafters"};
  app.require_subcommand(1);
  dspark::cli::add_demo_command(app);
  dspark::cli::add_generate_command(app);
  dspark::cli::add_perplexity_command(app);
  dspark::cli::add_bench_command(app);
  dspark::cli::add_bench_train_command(*app.get_subcommand("bench"));
  dspark::cli::add_draft_init_command(app);
  dspark::cli::add_regen_command(app);
  dspark::cli::add_train_command(app);
  dspark::cli::add_calibrate_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  } catch (const dspark::Error& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return 1;
  }
  return 0;
}
